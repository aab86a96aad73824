"""A model's trainable parameters as views into one tensor per (device, dtype).

Each parameter's values and gradient become views into one flat tensor and one flat gradient
of its group. The optimiser then updates one tensor per group (one fused call, none of
torch.optim's per-parameter bookkeeping), gradients are zeroed by one fill, and the backward
adds each parameter's gradient into its view instead of handing over a new tensor. Adam, AdamW
and SGD act element by element, so the updates are those of the separate parameters (torch's
fused Adam rounds some elements differently: its vector loop and its scalar tail differ).

The optimiser's state is saved per parameter (:meth:`FlatParameters.per_parameter`, the layout
torch gives the separate parameters) and read back from it (:meth:`FlatParameters.flat_state`),
so run files are the same either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn


class FlatParameters:
    """``params`` (trainable, in the optimiser's order) rebound as views into
    :attr:`tensors`, one flat :class:`torch.nn.Parameter` per (device, dtype) in order of first
    appearance, each with a flat ``.grad`` (zeros) whose slices are the parameters' gradients.
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = list(params)
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for index, p in enumerate(self.params):
            groups.setdefault((p.device, p.dtype), []).append(index)
        self.members = list(groups.values())  # per flat tensor: indices into params
        self.tensors: list[nn.Parameter] = []
        views: dict[int, torch.Tensor] = {}
        for members in self.members:
            flat = nn.Parameter(torch.cat([self.params[i].detach().reshape(-1) for i in members]))
            flat.grad = torch.zeros_like(flat)
            at = 0
            for i in members:
                p = self.params[i]
                n = p.numel()
                p.data = flat.data[at : at + n].view_as(p)
                p.grad = views[i] = flat.grad[at : at + n].view_as(p)
                at += n
            self.tensors.append(flat)
        self._grads = [views[i] for i in range(len(self.params))]  # in params' order

    def zero_grad(self) -> None:
        """Zeroes every gradient in place (one fill per flat tensor)."""
        for flat in self.tensors:
            flat.grad.zero_()

    def check(self) -> None:
        """Raises if a parameter's gradient is no longer its view (something set ``.grad`` to
        None or to a new tensor): the optimiser would not see it."""
        for p, view in zip(self.params, self._grads, strict=True):
            if p.grad is not view:
                raise RuntimeError(
                    "a parameter's gradient was replaced outside the trainer (zero_grad with "
                    "set_to_none, or an assignment to .grad); the flat optimiser would not see "
                    "it. Zero gradients through FlatParameters.zero_grad"
                )

    def per_parameter(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The optimiser's ``state_dict`` over :attr:`tensors` as torch gives it for the
        separate parameters: each flat state tensor cut into the parameters' shapes, each
        scalar one (Adam's step) repeated; one parameter group listing every parameter."""
        out: dict[int, dict[str, Any]] = {}
        for f, members in enumerate(self.members):
            entry = state["state"].get(f)
            if entry is None:
                continue
            at = 0
            for i in members:
                p = self.params[i]
                out[i] = {
                    key: _part(value, at, p)
                    if _per_element(key, value, self.tensors[f].numel())
                    else _copy(value)
                    for key, value in entry.items()
                }
                at += p.numel()
        return {"state": out, "param_groups": _groups(state, list(range(len(self.params))))}

    def flat_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The inverse of :meth:`per_parameter`: a per-parameter ``state_dict`` (as saved)
        for the optimiser over :attr:`tensors`. Raises ``ValueError`` naming the mismatch when
        it lists other parameters than this model's."""
        saved = state["state"]
        listed = [i for g in state["param_groups"] for i in g["params"]]
        if len(listed) != len(self.params):
            raise ValueError(
                f"the saved optimiser state holds {len(listed)} parameters, this model "
                f"{len(self.params)}: it was saved for another model"
            )
        out: dict[int, dict[str, Any]] = {}
        for f, members in enumerate(self.members):
            present = [i for i in members if i in saved]
            if not present:
                continue
            if len(present) != len(members):
                raise ValueError("the saved optimiser state covers only some of the parameters")
            first = saved[members[0]]
            out[f] = {}
            for key, value in first.items():
                if _per_element(key, value, self.params[members[0]].numel()):
                    parts = [saved[i][key].reshape(-1) for i in members]
                    out[f][key] = torch.cat(parts).to(self.tensors[f].device)
                else:
                    out[f][key] = _copy(value)
        return {"state": out, "param_groups": _groups(state, list(range(len(self.tensors))))}


def _per_element(key: str, value: Any, numel: int) -> bool:
    """A state entry with one number per element of its tensor (not Adam's step count)."""
    return key != "step" and torch.is_tensor(value) and value.numel() == numel


def _part(value: torch.Tensor, at: int, p: torch.Tensor) -> torch.Tensor:
    return value[at : at + p.numel()].view_as(p).clone()


def _copy(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value


def _groups(state: Mapping[str, Any], params: list[int]) -> list[dict[str, Any]]:
    """The saved hyperparameters (one group: the trainer makes one) over ``params``."""
    (group,) = state["param_groups"]
    return [{**group, "params": params}]
