"""Equivariance of the GSA-Net layers, measured for every group element: numbers, not prints.

Every function returns a list of records (dicts) with at least ``group``, ``kind``, ``element``
(a readable name), ``max_abs`` and ``max_rel`` (max |error| / max |reference output|), plus
``expected`` ("exact", "approximate" or "fail": a negative control that must show an error).

Checks (GSA-Nets Props. 4.1-4.3 and 5.1-5.2):
  * :func:`layer_equivariance`: ``layer(L_u f) = L_u layer(f)`` for every grid-exact u, for the
    lifting layer, group layer (``sum`` / ``single`` query forms, each group index), a block
    and the whole network (invariant logits), and the ``shifted`` negative control (reference
    indexing).
  * :func:`axis_response` / :func:`model_axis_response`: non-degeneracy, the second law. Moving
    a group layer's input along its group axis alone, f(x, m) -> f(x, u^-1 m), must change the
    output (``expected = "responds"``); an index that is blind to it (``relative`` and the
    reference's ``shifted`` in the sum form) is reported as ``"blind"``.
  * :func:`translation_equivariance`: integer shifts, compared away from the borders.
  * :func:`offgrid_equivariance`: 45 / 30 degree turns of smooth images by interpolation;
    errors are reported, they are not zero (the pixel grid is not rotation invariant).
  * :func:`pointset_equivariance`: global attention on a point set whose coordinates (not
    pixels) are rotated by every element, 45 / 30 degrees included: exact.
  * :func:`self_attention_facts`: permutation / translation facts of plain self-attention
    with no, absolute and relative position encodings, with negative controls.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from symattn_cli.groups import GROUP_NAMES, Group, get_group, grid_coordinates
from symattn_cli.models.gsa_net import GSABlock, GSANet
from symattn_cli.nn.gsa import DEFAULT_GROUP_INDEX, GroupSelfAttention
from symattn_cli.nn.positional import RelativePositionEncoding

LAYER_KINDS = ("lifting", "group_sum", "group_single", "block", "network", "group_shifted")
DEFAULT_KINDS = ("lifting", "group_sum", "group_single", "block", "network")
# group indices checked per query form, and the index of the other kinds' group layers
INDICES = ("pair", "gevit", "relative")
DEFAULT_INDEX = DEFAULT_GROUP_INDEX
# indices whose sum-form layer is unchanged by (g, m) -> (u g, u m), hence blind to its input's
# group axis: relative's g^-1 m, and the reference's m - g + v
BLIND_IN_SUM = ("relative", "shifted")
DTYPES = {"float64": torch.float64, "float32": torch.float32}
# relative error below which a check counts as exact, keyed by dtype
EXACT_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4}


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def randomize_encodings(module: nn.Module, seed: int = 0, std: float = 1.0) -> nn.Module:
    """Re-draw positional MLPs, group embeddings and norm affines as N(0, std^2) so that the
    position and group terms are far from zero when equivariance is measured."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for sub in module.modules():
            params = []
            if isinstance(sub, RelativePositionEncoding):
                params += list(sub.parameters())
            if isinstance(sub, GroupSelfAttention) and sub.group_embedding is not None:
                params.append(sub.group_embedding)
            if isinstance(sub, nn.GroupNorm) and sub.weight is not None:
                params += [sub.weight, sub.bias]
            for p in params:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)
    return module


def build_probe(
    group: Group,
    kind: str,
    *,
    image_size: int,
    channels: int = 6,
    heads: int = 2,
    patch_size: int | None = 3,
    dtype=torch.float64,
    seed: int = 0,
    index: str = DEFAULT_INDEX,
) -> tuple[nn.Module, torch.Tensor]:
    """A small randomly initialised module of ``kind`` and a random input for it; group
    layers, blocks and networks use the group index ``index`` (``group_shifted``: the
    reference's)."""
    if kind not in LAYER_KINDS:
        raise ValueError(f"kind={kind!r}; choose one of {LAYER_KINDS}")
    torch.manual_seed(seed)
    n, s = group.order, image_size
    common = dict(group=group, heads=heads, patch_size=patch_size, group_index=index)
    if kind == "group_shifted":
        common["group_index"] = "shifted"
    if kind == "lifting":
        module = GroupSelfAttention(in_channels=2, out_channels=channels, lifting=True, **common)
        x = torch.randn(2, 2, s, s)
    elif kind.startswith("group"):
        form = "single" if kind == "group_single" else "sum"
        module = GroupSelfAttention(
            in_channels=channels, out_channels=channels, query_form=form, **common
        )
        x = torch.randn(2, channels, n, s, s)
    elif kind == "block":
        attention = GroupSelfAttention(in_channels=channels, out_channels=2 * channels, **common)
        module = GSABlock(
            attention=attention, in_channels=channels, out_channels=2 * channels, crop_size=1
        )
        x = torch.randn(2, channels, n, s, s)
    else:  # network: pool only where the map is even, so rotations still act exactly
        blocks = [1, 1] if s % 2 == 0 else [2]
        module = GSANet(
            group=group, in_channels=1, num_classes=3, channels=channels, heads=heads,
            block_sizes=blocks, expansion=[1] * len(blocks), crops=[0] * sum(blocks),
            patch_size=patch_size, attention_dropout=0.0, value_dropout=0.0, group_index=index,
        )  # fmt: skip
        x = torch.randn(2, 1, s, s)
    module = randomize_encodings(module, seed).to(dtype).eval()
    return module, x.to(dtype)


def _transform_input(group: Group, kind: str, e: int, x: torch.Tensor, shift=(0, 0)):
    if kind in ("lifting", "network"):
        return group.act_on_image(e, x, shift)
    return group.act_on_group_function(e, x, shift)


def _transform_output(group: Group, kind: str, e: int, y: torch.Tensor, shift=(0, 0)):
    if kind == "network":
        return y  # invariant logits
    return group.act_on_group_function(e, y, shift)


def _record(group, kind, e, err, ref, expected, **extra) -> dict:
    max_abs = float(err.abs().max())
    scale = float(ref.abs().max())
    return {
        "group": group.name,
        "kind": kind,
        "element": group.describe(e) if isinstance(e, int) else str(e),
        "max_abs": max_abs,
        "max_rel": max_abs / max(scale, 1e-300),
        "expected": expected,
        **extra,
    }


def layer_equivariance(
    group_name: str,
    kind: str,
    *,
    dtype="float64",
    seed: int = 0,
    image_size: int = 6,
    channels: int = 6,
    heads: int = 2,
    patch_size: int | None = 3,
    device="cpu",
    index: str = DEFAULT_INDEX,
) -> list[dict]:
    """``max |layer(L_u f) - L_u layer(f)|`` for every grid-exact u of the group, computed on
    ``device``, with group index ``index``."""
    group, dt = get_group(group_name), _dtype(dtype)
    module, x = build_probe(
        group, kind, image_size=image_size, channels=channels, heads=heads,
        patch_size=patch_size, dtype=dt, seed=seed, index=index,
    )  # fmt: skip
    if kind == "group_shifted":
        index = "shifted"
    module, x = module.to(device), x.to(device)
    expected = "fail" if kind == "group_shifted" else "exact"
    with torch.no_grad():
        y = module(x)
        records = []
        for e in group.grid_exact_elements():
            moved = module(_transform_input(group, kind, e, x))
            err = moved - _transform_output(group, kind, e, y)
            records.append(
                _record(
                    group,
                    kind,
                    e,
                    err,
                    y,
                    expected,
                    image_size=image_size,
                    dtype=str(dt),
                    index=index,
                )  # fmt: skip
            )
    return records


def _axis_change(moved: torch.Tensor, y: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """The part of ``moved - y`` that neither invariance nor a permutation ``perm`` of the group
    axis (axis 2) explains: the smaller of the two differences, by max norm."""
    first = moved - y
    if perm is None:
        return first
    second = moved - y[:, :, perm]
    return first if first.abs().max() <= second.abs().max() else second


def axis_response(
    group_name: str,
    kind: str,
    *,
    index: str = DEFAULT_INDEX,
    dtype="float64",
    seed: int = 0,
    image_size: int = 6,
    patch_size: int | None = 3,
) -> list[dict]:
    """Non-degeneracy of a group layer (``group_sum`` / ``group_single``): for every u other
    than the identity, how much ``layer(f(x, u^-1 m))`` differs from both ``layer(f)`` and its
    group-axis permutation, relative to ``max |layer(f)|``. A layer blind to how its input's
    group axis lines up with space gives 0 (to rounding). ``patch_size=None``: global
    attention on a point set."""
    if kind not in ("group_sum", "group_single"):
        raise ValueError(f"the axis check covers group layers, not {kind!r}")
    group, dt = get_group(group_name), _dtype(dtype)
    module, x = build_probe(
        group, kind, image_size=image_size, patch_size=patch_size, dtype=dt, seed=seed,
        index=index,
    )  # fmt: skip
    blind = index in BLIND_IN_SUM and kind == "group_sum"
    gen = torch.Generator().manual_seed(seed)
    coords = torch.randn(image_size, 2, generator=gen, dtype=dt) * 3
    if patch_size is None:  # a point set: (B, C, N, I)
        x = torch.randn(2, module.query.in_channels, group.order, image_size, generator=gen,
                        dtype=dt)  # fmt: skip

    def run(inputs):
        return module(inputs) if patch_size is not None else module.forward_points(inputs, coords)

    records = []
    with torch.no_grad():
        y = run(x)
        for e in group.elements:
            if e == group.identity:
                continue
            perm = group.regular_permutation(e)
            err = _axis_change(run(x[:, :, perm]), y, perm)
            records.append(
                _record(
                    group,
                    kind,
                    e,
                    err,
                    y,
                    "blind" if blind else "responds",
                    index=index,
                    image_size=image_size,
                    points=patch_size is None,
                    dtype=str(dt),
                )  # fmt: skip
            )
    return records


def model_axis_response(
    model: nn.Module, x: torch.Tensor, elements: Sequence[int] | None = None
) -> list[dict]:
    """Non-degeneracy of every group layer of a GSA-Net, seen at the model's output: for each
    group self-attention layer and each u other than the identity, move that layer's input
    along its group axis alone and measure the change of ``model(x)`` relative to its size
    (the logits are invariant, so no permutation can explain a change). ``layer`` is the
    layer's module name; ``expected`` is ``"blind"`` for a sum-form layer with an index of
    :data:`BLIND_IN_SUM`, else ``"responds"``. ``elements``: the u to try (default: every
    one but the identity)."""
    group = model.group
    layers = [
        (name, m) for name, m in model.named_modules()
        if isinstance(m, GroupSelfAttention) and not m.lifting
    ]  # fmt: skip
    records = []
    with torch.no_grad():
        y = model(x)
        for name, layer in layers:
            blind = layer.group_index in BLIND_IN_SUM and layer.query_form == "sum"
            for e in elements or [e for e in group.elements if e != group.identity]:
                perm = group.regular_permutation(e, device=x.device)
                hook = layer.register_forward_pre_hook(
                    lambda _, args, perm=perm: (args[0][:, :, perm], *args[1:])
                )
                try:
                    moved = model(x)
                finally:
                    hook.remove()
                records.append(
                    _record(
                        group,
                        "network",
                        e,
                        moved - y,
                        y,
                        "blind" if blind else "responds",
                        layer=name,
                        index=layer.group_index,
                        query_form=layer.query_form,
                    )  # fmt: skip
                )
    return records


def translation_equivariance(
    group_name: str,
    kind: str,
    *,
    shift: tuple[int, int] = (2, -1),
    dtype="float64",
    seed: int = 0,
    image_size: int = 12,
    patch_size: int = 3,
    index: str = DEFAULT_INDEX,
) -> list[dict]:
    """Integer translation of the input (cyclic) vs of the output, compared on the interior
    (``patch_size // 2 + |shift|`` pixels from every border are left out)."""
    if kind not in ("lifting", "group_sum", "group_single", "group_shifted"):
        raise ValueError(f"translation check covers single layers, not {kind!r}")
    group, dt = get_group(group_name), _dtype(dtype)
    module, x = build_probe(
        group, kind, image_size=image_size, patch_size=patch_size, dtype=dt, seed=seed,
        index=index,
    )  # fmt: skip
    with torch.no_grad():
        y = module(x)
        moved = module(_transform_input(group, kind, 0, x, shift))
        expect = _transform_output(group, kind, 0, y, shift)
    margin = patch_size // 2 + max(abs(shift[0]), abs(shift[1]))
    inner = (..., slice(margin, image_size - margin), slice(margin, image_size - margin))
    return [
        _record(group, kind, f"shift{shift}", moved[inner] - expect[inner], y, "exact",
                image_size=image_size, dtype=str(dt), index=index)
    ]  # fmt: skip


def smooth_image(size: int, batch: int = 2, channels: int = 2, seed: int = 0, dtype=torch.float64):
    """Sums of wide Gaussian blobs inside the inscribed disk (so rotations lose nothing)."""
    gen = torch.Generator().manual_seed(seed)
    coords = grid_coordinates(size, size, dtype=dtype)  # (H, W, 2)
    radius = (size - 1) / 2
    out = torch.zeros(batch, channels, size, size, dtype=dtype)
    for b in range(batch):
        for c in range(channels):
            for _ in range(3):
                centre = (torch.rand(2, generator=gen, dtype=dtype) - 0.5) * radius
                width = radius * (0.25 + 0.15 * float(torch.rand(1, generator=gen)))
                d2 = ((coords - centre) ** 2).sum(-1)
                out[b, c] += torch.exp(-d2 / (2 * width**2)) * float(torch.randn(1, generator=gen))
    return out


def rotate_image(f: torch.Tensor, angle: float, reflect: bool = False) -> torch.Tensor:
    """``(L_u f)(x) = f(u^-1 x)`` on ``(..., H, W)`` by bilinear interpolation (zeros outside)."""
    h, w = f.shape[-2:]
    coords = grid_coordinates(h, w, dtype=f.dtype)  # (H, W, 2)
    c, s = math.cos(angle), math.sin(angle)
    inv = torch.tensor([[c, s], [-s, c]], dtype=f.dtype)  # R(-angle)
    src = coords @ inv.T  # u^-1 x for a rotation
    if reflect:
        src = src * torch.tensor([-1.0, 1.0], dtype=f.dtype)  # M^-1 = M: x -> -x
    gx = src[..., 0] / ((w - 1) / 2)
    gy = -src[..., 1] / ((h - 1) / 2)
    grid = torch.stack([gx, gy], dim=-1)  # (H, W, 2) in grid_sample's (x, y-down) convention
    flat = f.reshape(-1, 1, h, w)
    out = F.grid_sample(flat, grid[None].expand(flat.shape[0], h, w, 2), align_corners=True)
    return out.reshape(f.shape)


def offgrid_equivariance(
    group_name: str,
    kind: str = "lifting",
    *,
    dtype="float64",
    seed: int = 0,
    image_size: int = 15,
    patch_size: int = 5,
) -> list[dict]:
    """Turns that are not multiples of 90 degrees, by interpolation, on smooth images.

    Errors are compared inside the disk of radius ``(size - 1) / 2 - patch_size`` and are
    labelled ``approximate``: they measure interpolation, not a defect of the layer.
    """
    if kind != "lifting":
        raise ValueError("off-grid checks are defined for the lifting layer")
    group, dt = get_group(group_name), _dtype(dtype)
    module, _ = build_probe(
        group, kind, image_size=image_size, patch_size=patch_size, dtype=dt, seed=seed
    )
    x = smooth_image(image_size, seed=seed, dtype=dt)
    coords = grid_coordinates(image_size, image_size, dtype=dt)
    disk = coords.norm(dim=-1) <= (image_size - 1) / 2 - patch_size  # (H, W)
    records = []
    with torch.no_grad():
        y = module(x)  # (B, C, N, H, W)
        for e in group.elements:
            if group.is_grid_exact(e):
                continue
            angle, reflect = group.angle(e), group.is_reflection(e)
            moved = module(rotate_image(x, angle, reflect))
            expect = rotate_image(y[:, :, group.regular_permutation(e)], angle, reflect)
            err = (moved - expect)[..., disk]
            records.append(
                _record(group, kind, e, err, y[..., disk], "approximate", image_size=image_size)
            )
    return records


def pointset_equivariance(
    group_name: str,
    kind: str = "lifting",
    *,
    points: int = 12,
    dtype="float64",
    seed: int = 0,
    index: str = DEFAULT_INDEX,
) -> list[dict]:
    """Global attention on a point set: rotate the coordinates by every u (off-grid angles
    included) and permute the group axis; the outputs must agree to rounding."""
    if kind not in ("lifting", "group_sum", "group_single"):
        raise ValueError(f"point-set check covers lifting and group layers, not {kind!r}")
    group, dt = get_group(group_name), _dtype(dtype)
    module, _ = build_probe(
        group, kind, image_size=4, patch_size=None, dtype=dt, seed=seed, index=index
    )
    gen = torch.Generator().manual_seed(seed)
    coords = torch.randn(points, 2, generator=gen, dtype=dt) * 3
    n = group.order
    if kind == "lifting":
        x = torch.randn(2, 2, points, generator=gen, dtype=dt)
    else:
        x = torch.randn(2, module.query.in_channels, n, points, generator=gen, dtype=dt)
    records = []
    with torch.no_grad():
        y = module.forward_points(x, coords)  # (B, C, N, I)
        for e in group.elements:
            moved_x = x if kind == "lifting" else x[:, :, group.regular_permutation(e)]
            moved = module.forward_points(moved_x, group.act_on_coordinates(e, coords))
            err = moved - y[:, :, group.regular_permutation(e)]
            records.append(_record(group, kind, e, err, y, "exact", points=points, index=index))
    return records


def self_attention_facts(*, points: int = 10, channels: int = 4, seed: int = 0) -> list[dict]:
    """GSA-Nets Props. 4.1-4.3 on global self-attention over a point set (float64).

    no encoding: permutation equivariant (exact); absolute encoding (a fixed function of the
    point's coordinates added to its features, Eq. 10): permutation and translation are
    broken (negative controls, ``expected = "fail"``); relative encoding: translation
    invariant coordinates, so translation and joint permutation are exact.
    """
    z2 = get_group("z2")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    dt = torch.float64
    x = torch.randn(2, channels, points, generator=gen, dtype=dt)
    coords = torch.randn(points, 2, generator=gen, dtype=dt) * 3
    perm = torch.randperm(points, generator=gen)
    shift = torch.tensor([1.5, -2.0], dtype=dt)

    def layer(position: str) -> GroupSelfAttention:
        module = GroupSelfAttention(
            group=z2, in_channels=channels, out_channels=channels, heads=2, patch_size=None,
            lifting=True, position=position, max_offset=5.0,
        )  # fmt: skip
        return randomize_encodings(module, seed).to(dt).eval()

    absolute = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, channels)).to(dt)

    def with_absolute(module, feats, pts):
        return module.forward_points(feats + absolute(pts).T[None], pts)

    records = []

    def add(name, out, expect, expected):
        err = out - expect
        records.append(_record(z2, "self_attention", name, err, expect, expected))

    with torch.no_grad():
        plain, rel = layer("none"), layer("relative")
        y = plain.forward_points(x, coords)
        add("no_encoding_permutation", plain.forward_points(x[..., perm], coords), y[..., perm],
            "exact")  # fmt: skip
        y = with_absolute(plain, x, coords)
        add("absolute_encoding_permutation", with_absolute(plain, x[..., perm], coords),
            y[..., perm], "fail")  # fmt: skip
        add("absolute_encoding_translation", with_absolute(plain, x, coords + shift), y, "fail")
        y = rel.forward_points(x, coords)
        add("relative_encoding_translation", rel.forward_points(x, coords + shift), y, "exact")
        add("relative_encoding_joint_permutation",
            rel.forward_points(x[..., perm], coords[perm]), y[..., perm], "exact")  # fmt: skip
        add("relative_encoding_feature_permutation",
            rel.forward_points(x[..., perm], coords), y[..., perm], "fail")  # fmt: skip
    return records


def run_all(
    groups: Sequence[str] | None = None,
    kinds: Iterable[str] | None = None,
    *,
    dtype="float64",
    seed: int = 0,
    image_sizes: Sequence[int] = (6, 7),
    offgrid: bool = True,
) -> list[dict]:
    """Every check for every group and layer kind; the ``verify-equivariance`` payload."""
    groups = list(groups or GROUP_NAMES)
    kinds = list(kinds or DEFAULT_KINDS)
    records: list[dict] = []
    for name in groups:
        group = get_group(name)
        for kind in kinds:
            indices = INDICES if kind in ("group_sum", "group_single") else (DEFAULT_INDEX,)
            for index in indices:
                for size in image_sizes:
                    records += layer_equivariance(
                        name, kind, dtype=dtype, seed=seed, image_size=size, index=index
                    )
                if kind in ("lifting", "group_sum", "group_single"):
                    records += translation_equivariance(
                        name, kind, dtype=dtype, seed=seed, index=index
                    )
                    records += pointset_equivariance(name, kind, dtype=dtype, seed=seed,
                                                     index=index)  # fmt: skip
                if kind in ("group_sum", "group_single") and group.order > 1:
                    for patch in (3, None):  # local and global
                        records += axis_response(name, kind, index=index, dtype=dtype,
                                                 seed=seed, patch_size=patch)  # fmt: skip
            if kind == "network" and group.order > 1:
                # 12 channels: 6 per head, 2 of them for the group term (the equivariance
                # probe's 6 leave one, whose effect at the logits is too faint to measure)
                module, x = build_probe(group, kind, image_size=image_sizes[0], channels=12,
                                        seed=seed, dtype=_dtype(dtype))  # fmt: skip
                records += model_axis_response(module, x)
        if (
            offgrid
            and "lifting" in kinds
            and any(not get_group(name).is_grid_exact(e) for e in get_group(name).elements)
        ):
            records += offgrid_equivariance(name, dtype=dtype, seed=seed)
    records += self_attention_facts(seed=seed)
    return records


def summarize(records: list[dict]) -> list[dict]:
    """Max relative error per (group, kind, expected)."""
    table: dict[tuple, dict] = {}
    for r in records:
        key = (r["group"], r["kind"], r["expected"])
        row = table.setdefault(key, {"group": key[0], "kind": key[1], "expected": key[2],
                                     "max_rel": 0.0, "checks": 0})  # fmt: skip
        row["max_rel"] = max(row["max_rel"], r["max_rel"])
        row["checks"] += 1
    return list(table.values())


def format_summary(rows: list[dict]) -> str:
    lines = [f"{'group':8} {'kind':22} {'expected':12} {'checks':>6} {'max rel err':>12}"]
    for r in rows:
        lines.append(
            f"{r['group']:8} {r['kind']:22} {r['expected']:12} {r['checks']:6d} "
            f"{r['max_rel']:12.2e}"
        )
    return "\n".join(lines)
