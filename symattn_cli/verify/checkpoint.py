"""Checks of a trained model, read from its run file (``verify-equivariance checkpoint=``).

Image models: every group self-attention layer at the trained weights (its input captured on
real digits, each grid-exact element applied to that input), and on the test split of
``rotmnist_mini`` the share of predictions that stay the same when each group element is
applied to the digits (100% for grid-exact elements of an equivariant model) and for
off-grid angles (measured). Knowledge-attention models: the embedding-transfer check.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from symattn_cli.errors import UserError
from symattn_cli.verify.records import Check

OFFGRID_DEGREES = (45.0, 30.0)


def load_trained(
    path: Path, data_root: Path, named: set[str] = frozenset()
) -> tuple[nn.Module, Any, dict]:
    """The model of a run file with its best weights, its data bundle and its config. The run
    file's ``_target_`` s must be shipped ones or in ``named`` (the command line's): a file
    does not choose the code that runs."""
    from omegaconf import OmegaConf, open_dict

    from symattn_cli.configs.targets import check_trusted
    from symattn_cli.models.instantiate import build, upgrade_stored
    from symattn_cli.train.runfile import read_config_yaml, read_weights

    stored = OmegaConf.create(read_config_yaml(path))
    if "model" not in stored or "data" not in stored:
        raise UserError(f"{path} holds no training config; pass the run.h5 of `symattn train`")
    check_trusted({"model": stored.model, "data": stored.data}, named, path, "checkpoint")
    stored = upgrade_stored(stored)
    with open_dict(stored):
        stored.data_root = str(data_root)
    config = OmegaConf.create({"model": stored.model, "data": stored.data,
                               "data_root": stored.data_root})  # fmt: skip
    data, model = build(config)
    config = OmegaConf.to_container(config, resolve=True)
    weights = {k: torch.from_numpy(v) for k, v in read_weights(path).items()}
    model.load_state_dict(weights)
    return model.eval(), data, config


def _batches(dataset: Any, collate: Any, limit: int, batch_size: int = 100):
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, collate_fn=collate)
    seen = 0
    for batch in loader:
        yield batch
        seen += batch[0].shape[0]
        if seen >= limit:
            return


def image_checks(model: nn.Module, images: torch.Tensor, *, dtype: str) -> list[Check]:
    """Layer errors at the trained weights, prediction agreement under the group, and the
    non-degeneracy of every group layer (the model's output must change when the layer's
    input moves along its group axis alone)."""
    from symattn_cli.nn.gsa import GroupSelfAttention
    from symattn_cli.verify.gsa import model_axis_response, rotate_image

    group = getattr(model, "group", None)
    torch_dtype = {"float64": torch.float64, "float32": torch.float32}[dtype]
    model = model.to(torch_dtype).eval()
    images = images.to(torch_dtype)
    rows: list[Check] = []
    name = group.name if group is not None else "none"
    with torch.no_grad():
        captured: dict[str, torch.Tensor] = {}

        def capture(key: str):
            def hook(module, args, output) -> None:  # returns None: the output is kept
                captured.setdefault(key, args[0][:4])

            return hook

        hooks = [
            module.register_forward_hook(capture(key))
            for key, module in model.named_modules()
            if isinstance(module, GroupSelfAttention)
        ]
        logits = model(images)
        for hook in hooks:
            hook.remove()
        layers = dict(model.named_modules())
        elements = group.grid_exact_elements() if group is not None else []
        for key, inputs in captured.items():
            layer = layers[key]
            reference = layer(inputs)
            for e in elements:
                moved_in = (group.act_on_image(e, inputs) if layer.lifting
                            else group.act_on_group_function(e, inputs))  # fmt: skip
                err = layer(moved_in) - group.act_on_group_function(e, reference)
                rows.append(_row(name, f"trained {key}", group.describe(e), err, reference,
                                 dtype))  # fmt: skip
        predictions = logits.argmax(-1)
        for e in elements:
            moved = model(group.act_on_image(e, images))
            rows.append(_row(name, "trained model logits", group.describe(e),
                             moved - logits, logits, dtype))  # fmt: skip
            same = float((moved.argmax(-1) == predictions).double().mean())
            rows.append(_agreement(name, group.describe(e), same, "exact", len(images)))
        for degrees in OFFGRID_DEGREES:
            moved = model(rotate_image(images, math.radians(degrees)))
            same = float((moved.argmax(-1) == predictions).double().mean())
            rows.append(_agreement(name, f"rot{degrees:g} (interpolated)", same,
                                   "approximate", len(images)))  # fmt: skip
        if group is not None and group.order > 1:
            for r in model_axis_response(model, images[:8]):
                rows.append(Check("checkpoint", name, f"trained {r['layer']} · group axis alone",
                                  r["element"], r["max_abs"], r["max_rel"], r["expected"],
                                  dtype, note=f"{r['query_form']}, {r['index']}"))  # fmt: skip
        if group is None:  # a model without rotation symmetry: 90° turns are only measured
            for quarter in (1, 2, 3):
                moved = model(torch.rot90(images, quarter, dims=(-2, -1)))
                same = float((moved.argmax(-1) == predictions).double().mean())
                rows.append(_agreement(name, f"rot{90 * quarter}", same, "approximate",
                                       len(images)))  # fmt: skip
    return rows


def _row(group: str, layer: str, element: str, err, reference, dtype: str) -> Check:
    max_abs = float(err.abs().max())
    return Check("checkpoint", group, layer, element, max_abs,
                 max_abs / max(float(reference.abs().max()), 1e-300), "exact", dtype)  # fmt: skip


def _agreement(group: str, element: str, same: float, expect: str, count: int) -> Check:
    """Prediction agreement as a row: the error is the share of changed predictions."""
    return Check("checkpoint", group, "same prediction on test digits", element, 1.0 - same,
                 1.0 - same, expect, "float64", bound=0.0 if expect == "exact" else None,
                 note=f"{same:.2%} of {count} unchanged")  # fmt: skip


def knowledge_checks(model: nn.Module, data: Any, *, seed: int) -> list[Check]:
    from symattn_cli.verify.knowledge import embedding_transfer

    result = embedding_transfer(model, _batches(data.test, data.collate, 1000), seed=seed)
    note = (f"exact acc {result['exact_acc']:.2%} → rotated {result['rotated_exact_acc']:.2%}; "
            f"embedding alone {result['embedding_only_exact_acc']:.2%}")  # fmt: skip
    agree = 1.0 - result["agreement"]
    return [
        Check(
            "checkpoint",
            "O(d)",
            "embedding + knowledge rotated",
            "4 Haar Q",
            result["logit_error"],
            result["logit_error"],
            "exact",
            "float64",
            note=note,
        ),  # fmt: skip
        Check(
            "checkpoint",
            "O(d)",
            "same prediction on test split",
            "4 Haar Q",
            agree,
            agree,
            "exact",
            "float64",
            bound=0.0,
            note=f"{result['agreement']:.2%} unchanged",
        ),  # fmt: skip
        Check(
            "checkpoint",
            "O(d)",
            "embedding rotated alone: token acc drop",
            "4 Haar Q",
            result["token_acc"] - result["embedding_only_token_acc"],
            result["token_acc"] - result["embedding_only_token_acc"],
            "violation",
            "float64",
            note=f"token acc {result['embedding_only_token_acc']:.2%}, chance "
            f"{result['chance_token_acc']:.2%}",
        ),  # fmt: skip
    ]


def checkpoint_checks(
    model: nn.Module,
    data: Any,
    images: torch.Tensor | None,
    *,
    dtype: str,
    seed: int,
    announce: Callable[[str], None] | None = None,
) -> list[Check]:
    """The checks of a trained model (:func:`load_trained`): on ``images`` (from
    :func:`checkpoint_images`) for an image model, on its test split for a token model.
    ``announce`` hears, before the long part, what it is."""
    if data.spec.task == "tokens":
        return knowledge_checks(model, data, seed=seed)
    group = getattr(model, "group", None)
    passes = 1 + len(OFFGRID_DEGREES) + (len(group.grid_exact_elements()) if group else 3)
    if announce is not None:
        announce(f"checking {type(model).__name__} on {len(images)} test images, {passes} "
                 f"passes in {dtype} (checkpoint_images=N checks fewer)")  # fmt: skip
    return image_checks(model, images, dtype=dtype)


def checkpoint_images(data: Any, data_root: Path, limit: int) -> torch.Tensor:
    """Up to ``limit`` test images ``(B, C, H, W)`` for an image model: real rotated digits
    (the test split of rotmnist_mini) for one-channel models, else the run's own test split."""
    from symattn_cli.data.images import build

    if data.spec.in_channels == 1:
        digits = build("rotmnist_mini", {}, data_root).test
    else:
        digits = data.test
    return torch.stack([digits[i][0] for i in range(min(limit, len(digits)))])
