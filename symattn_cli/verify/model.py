"""Any model's symmetry, measured whole: ``verify-equivariance model=<name>``.

For each element u of each named group, the model's output on the turned (or flipped) input
against the output turned as the model declares (:data:`OUTPUT_ACTIONS`):

    invariant:  f(L_u x) = f(x)                   logits (B, K), the default
    image:      f(L_u x) = L_u f(x)               maps (B, C, H, W)
    regular:    f(L_u x) = L_u f(x)               group maps (B, C, N, H, W), u acting on
                                                   space and on the group axis

A model declares its output's action by an attribute ``output_action`` (one of the names
above). Elements that map the pixel grid onto itself are exact in a claimed group (relative
error <= 1e-10 in float64, else FAIL); the others are turned by interpolation and only
measured, as is every element of an unclaimed group. Non-degeneracy of the whole model: its
output must change (>= 1e-6 relative) when the input changes by a random image, which no
element fixes. Every group self-attention layer inside is checked as the shipped ones are:
its equivariance on the input it receives, for each grid-exact element of its own group, and
its response to a move of its input along its group axis alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from symattn_cli.errors import ConfigError
from symattn_cli.groups import Group
from symattn_cli.verify.records import Check

OUTPUT_ACTIONS = ("invariant", "image", "regular")
FAMILY = "model"


def output_action(model: nn.Module, output: torch.Tensor) -> str:
    """The declared ``output_action`` of ``model``, or ``invariant`` for 2-D outputs."""
    declared = getattr(model, "output_action", None)
    if declared is None:
        if output.dim() == 2:
            return "invariant"
        raise ConfigError(
            f"{type(model).__name__} returns shape {tuple(output.shape)}, not logits (B, K); "
            f"declare how the group acts on it with an attribute output_action = "
            f"{' | '.join(OUTPUT_ACTIONS)}"
        )
    if declared not in OUTPUT_ACTIONS:
        raise ConfigError(
            f"{type(model).__name__}.output_action={declared!r}; choose one of {OUTPUT_ACTIONS}"
        )
    return declared


def _act_on_output(group: Group, e: int, y: torch.Tensor, action: str) -> torch.Tensor:
    if action == "invariant":
        return y
    if action == "image":
        return group.act_on_image(e, y)
    return group.act_on_group_function(e, y)


def _check(
    symmetry: str,
    layer: str,
    element: str,
    err: torch.Tensor,
    ref: torch.Tensor,
    expect: str,
    dtype: str,
    note: str = "",
) -> Check:
    max_abs = float(err.abs().max())
    rel = max_abs / max(float(ref.abs().max()), 1e-300)
    return Check(FAMILY, symmetry, layer, element, max_abs, rel, expect, dtype, note=note)


def model_checks(
    model: nn.Module,
    x: torch.Tensor,
    groups: Sequence[Group],
    claims: Sequence[str],
    *,
    dtype: str = "float64",
    seed: int = 0,
) -> list[Check]:
    """The rows of :mod:`this module <symattn_cli.verify.model>` for ``model`` on inputs ``x``
    ``(B, C, H, W)``; ``claims`` names the groups (by :attr:`Group.name`) the model must
    respect exactly."""
    from symattn_cli.verify.gsa import rotate_image

    torch_dtype = {"float64": torch.float64, "float32": torch.float32}[dtype]
    model = model.to(torch_dtype).eval()
    x = x.to(torch_dtype)
    rows: list[Check] = []
    with torch.no_grad():
        y = model(x)
        action = output_action(model, y)
        for group in groups:
            claimed = group.name in claims
            exact = set(group.grid_exact_elements())
            for e in group.elements:
                if e in exact:
                    moved = model(group.act_on_image(e, x))
                    err = moved - _act_on_output(group, e, y, action)
                    rows.append(_check(group.name, f"model ({action})", group.describe(e), err, y,
                                       "exact" if claimed else "approximate", dtype,
                                       "" if claimed else "not claimed"))  # fmt: skip
                elif action == "invariant":  # off the grid: interpolated, measured
                    turned = rotate_image(x, group.angle(e), reflect=group.is_reflection(e))
                    rows.append(_check(group.name, f"model ({action})",
                                       f"{group.describe(e)} (interpolated)", model(turned) - y,
                                       y, "approximate", dtype))  # fmt: skip
        noise = torch.randn(x.shape, dtype=torch_dtype,
                            generator=torch.Generator().manual_seed(seed))  # fmt: skip
        moved = model(x + 0.5 * noise * x.abs().max().clamp_min(1e-12))
        rows.append(_check(", ".join(claims) or "none", "model · input changed",
                           "x + random image", moved - y, y, "responds", dtype))  # fmt: skip
    rows += attention_layer_checks(model, x, dtype=dtype)
    return rows


def attention_layer_checks(model: nn.Module, x: torch.Tensor, *, dtype: str) -> list[Check]:
    """Both laws for every group self-attention layer inside ``model``, on the input it
    receives from ``x``: ``layer(L_u f) = L_u layer(f)`` for each grid-exact u of the layer's
    group, and the model's output responding to a move of a group layer's input along its
    group axis alone (blind as expected for the sum form with a blind index)."""
    from symattn_cli.nn.gsa import GroupSelfAttention
    from symattn_cli.verify.gsa import BLIND_IN_SUM

    layers = {name: m for name, m in model.named_modules() if isinstance(m, GroupSelfAttention)}
    captured: dict[str, torch.Tensor] = {}

    def capture(name: str):
        def hook(module, args, output) -> None:  # returns None: the output is kept
            captured.setdefault(name, args[0][:2])

        return hook

    hooks = [layer.register_forward_hook(capture(name)) for name, layer in layers.items()]
    rows: list[Check] = []
    with torch.no_grad():
        try:
            y = model(x)
        finally:
            for hook in hooks:
                hook.remove()
        for name, inputs in captured.items():
            layer, group = layers[name], layers[name].group
            kind = "lifting" if layer.lifting else f"group-{layer.query_form}"
            reference = layer(inputs)
            for e in group.grid_exact_elements():
                moved_in = (group.act_on_image(e, inputs) if layer.lifting
                            else group.act_on_group_function(e, inputs))  # fmt: skip
                err = layer(moved_in) - group.act_on_group_function(e, reference)
                rows.append(_check(group.name, f"{name} ({kind})", group.describe(e), err,
                                   reference, "exact", dtype))  # fmt: skip
            if layer.lifting or group.order == 1:
                continue
            blind = layer.group_index in BLIND_IN_SUM and layer.query_form == "sum"
            for e in [e for e in group.elements if e != group.identity]:
                perm = group.regular_permutation(e, device=x.device)
                hook = layer.register_forward_pre_hook(
                    lambda _, args, perm=perm: (args[0][:, :, perm], *args[1:])
                )
                try:
                    moved = model(x)
                finally:
                    hook.remove()
                rows.append(_check(group.name, f"{name} · group axis alone", group.describe(e),
                                   moved - y, y, "blind" if blind else "responds", dtype,
                                   f"{layer.query_form}, {layer.group_index}"))  # fmt: skip
    return rows


def sample_inputs(data: Any, count: int = 4, seed: int = 0) -> torch.Tensor:
    """``count`` inputs ``(B, C, S, S)`` for a model of image data: the first test images, or
    a smooth random image when the split is empty (S from the data's facts)."""
    test = data.test
    if len(test) > 0:
        return torch.stack([torch.as_tensor(test[i][0]) for i in range(min(count, len(test)))])
    from symattn_cli.verify.gsa import smooth_image

    spec = data.spec
    return smooth_image(spec.image_size, batch=count, channels=spec.in_channels, seed=seed)
