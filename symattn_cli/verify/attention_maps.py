"""Attention maps over the group: where a GSA-Net's lifting layer looks, per output element.

For one query pixel of an image the lifting layer has one attention map per output group
element v, P x P (or the whole image, for global attention): GSA-Nets Eq. 14 reads the
positional encoding through v^-1. Turning the image by u moves the query to u.pixel, and
there its map for u v is the map for v turned by u: the attention itself is equivariant, not
only the output. The figure shows both rows and the largest difference between them,
measured, in its title.

Letters: V output group elements (= N), G query elements, M key elements, P the
neighbourhood side, H x W the layer's input map; u the element applied, v an output element.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from symattn_cli.groups import Group
from symattn_cli.nn.gsa import GroupSelfAttention

ATTENTION_FILE = "attention.png"


@dataclass
class AttentionMaps:
    """Head-averaged lifting-layer attention of one query, before and after a turn ``u``."""

    group: Group
    image: torch.Tensor  # (H, W): the lifting layer's input (first channel)
    pixel: tuple[int, int]
    maps: torch.Tensor  # (V, P, P), or (V, H, W) when global: the query's map for each v
    element: int | None  # u, or None for a group with no element besides the identity
    moved_image: torch.Tensor | None  # (H, W): L_u image
    moved_pixel: tuple[int, int] | None  # u.pixel
    moved_maps: torch.Tensor | None  # like maps; column v holds the map for u v
    max_difference: float  # max |moved_maps[v] - L_u maps[v]| over v and offsets
    patch_size: int | None = None  # the layer's P; None: global attention
    # The first group layer, at the busiest pixel of its input: the weight on key element m
    # for output element v, (V, M) (mean over heads and query elements, summed over the
    # neighbours); for the turned input with row v holding u v, which puts on m the weight
    # of u^-1 m; and the largest difference from that law.
    group_weights: torch.Tensor | None = None
    moved_group_weights: torch.Tensor | None = None
    group_difference: float = 0.0


def lifting_layer(model: nn.Module) -> GroupSelfAttention | None:
    """The model's first lifting self-attention layer (local or global), if it has one."""
    for module in model.modules():
        if isinstance(module, GroupSelfAttention) and module.lifting:
            return module
    return None


def turning_element(group: Group) -> int | None:
    """The element the figure applies: a quarter turn if the group has one, else the first
    other element that acts exactly on the pixel grid (a reflection), else ``None``."""
    exact = [e for e in group.grid_exact_elements() if e != group.identity]
    turns = [e for e in exact if not group.is_reflection(e)]
    return min(turns, key=group.angle) if turns else (exact[0] if exact else None)


def group_layer(model: nn.Module) -> GroupSelfAttention | None:
    """The model's first group self-attention layer (after the lifting), if it has one."""
    for module in model.modules():
        if isinstance(module, GroupSelfAttention) and not module.lifting:
            return module
    return None


def _layer_inputs(model: nn.Module, layers: list[nn.Module], image: torch.Tensor) -> list:
    """What each of ``layers`` receives when ``model`` sees ``image`` (one forward pass)."""
    seen: dict[int, torch.Tensor] = {}
    handles = [
        layer.register_forward_pre_hook(lambda module, args, i=i: seen.setdefault(i, args[0]))
        for i, layer in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            model(image)
    finally:
        for handle in handles:
            handle.remove()
    return [seen[i] for i in range(len(layers))]


def _moved_pixel(group: Group, u: int, pixel: tuple[int, int], shape) -> tuple[int, int]:
    """u.pixel on a map of ``shape`` (H, W), by the exact grid action itself."""
    spot = torch.zeros(shape)
    spot[pixel] = 1.0
    return divmod(int(group.act_on_grid(u, spot).argmax()), shape[1])


def _group_weights(layer: GroupSelfAttention, x: torch.Tensor, pixel) -> torch.Tensor:
    weights = layer.attention_weights(x, pixel).mean(0)  # (V, G, P, P, M)
    return weights.sum((2, 3)).mean(1)  # (V, M): each row sums to 1


def busiest_pixel(x: torch.Tensor, patch_size: int) -> tuple[int, int]:
    """The pixel whose P x P neighbourhood holds the most input (on a digit's stroke, not in
    the empty background, where every key is the same and the attention is flat)."""
    mass = x.abs().sum(1, keepdim=True)  # (1, 1, H, W)
    box = nn.functional.avg_pool2d(mass, patch_size, stride=1, padding=patch_size // 2)
    return divmod(int(box.flatten().argmax()), x.shape[-1])


def _head_mean(layer: GroupSelfAttention, x: torch.Tensor, pixel) -> torch.Tensor:
    return layer.attention_weights(x, pixel)[:, :, 0, :, :, 0].mean(0)  # (V, P, P) or (V, H, W)


def lifting_attention_maps(
    model: nn.Module, image: torch.Tensor, pixel: tuple[int, int] | None = None
) -> AttentionMaps:
    """The maps of ``model``'s lifting layer for ``image`` ``(1, C, H, W)`` at ``pixel`` (by
    default :func:`busiest_pixel` of the layer's input), and for the image turned by
    :func:`turning_element`."""
    layer = lifting_layer(model)
    if layer is None:
        raise ValueError("the model has no lifting self-attention layer to show")
    group = layer.group
    model = model.eval()
    second = group_layer(model)
    layers = [layer] if second is None else [layer, second]
    x, *rest = _layer_inputs(model, layers, image)  # as the layers see them
    pixel = pixel or busiest_pixel(x, layer.patch_size or 5)
    maps = _head_mean(layer, x, pixel)
    weights = None
    if second is not None:  # group features (1, C, N, H', W'): busiest over C and N
        gx = rest[0]
        group_pixel = busiest_pixel(gx.flatten(1, 2), second.patch_size or 5)
        weights = _group_weights(second, gx, group_pixel)
    u = turning_element(group)
    if u is None:
        return AttentionMaps(group, x[0, 0], pixel, maps, None, None, None, None, 0.0,
                             layer.patch_size, weights)  # fmt: skip
    moved_x, *moved_rest = _layer_inputs(model, layers, group.act_on_grid(u, image))
    moved_pixel = _moved_pixel(group, u, pixel, x.shape[-2:])
    moved = _head_mean(layer, moved_x, moved_pixel)
    moved = moved[group.cayley[u]]  # column v: the map for u v
    difference = (moved - group.act_on_grid(u, maps)).abs().max().item()
    result = AttentionMaps(group, x[0, 0], pixel, maps, u, moved_x[0, 0], moved_pixel, moved,
                           difference, layer.patch_size)  # fmt: skip
    if second is not None:
        moved_weights = _group_weights(
            second, moved_rest[0], _moved_pixel(group, u, group_pixel, gx.shape[-2:])
        )[group.cayley[u]]  # row v: output u v
        aligned = moved_weights[:, group.cayley[u]]  # [v, m]: output u v, key u m
        result.group_weights, result.moved_group_weights = weights, moved_weights
        result.group_difference = (aligned - weights).abs().max().item()
    return result


def attention_figure(result: AttentionMaps, title: str = ""):
    """The matplotlib figure of :func:`plot_attention_maps`: short titles, axis labels, a
    legend and colour bars; what it shows is explained in docs/gsa-nets.md (Attention maps).

    Row 1 is the input, row 2 the input turned by u. Columns: the input (query marked), the
    query's lifting-layer map for each output element (v, then u·v), and, for a model with
    group layers, the first group layer's weight per output and key element.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    group = result.group
    u = None if result.element is None else group.describe(result.element)
    rows = [(result.image, result.pixel, result.maps, "v", result.group_weights)]
    if u is not None:
        rows.append((result.moved_image, result.moved_pixel, result.moved_maps, f"{u}·v",
                     result.moved_group_weights))  # fmt: skip
    n, p = group.order, result.patch_size
    moved = "flipped" if u is not None and group.is_reflection(result.element) else "turned"
    columns = n + 1 + (result.group_weights is not None)
    size = (1.5 * columns + 1.0, 1.7 * len(rows) + 0.9)
    fig, axes = plt.subplots(len(rows), columns, figsize=size, squeeze=False, layout="constrained")
    low = float(min(r[2].min() for r in rows))
    top = float(max(r[2].max() for r in rows))
    if result.group_weights is not None:
        g_low = float(min(r[4].min() for r in rows))
        g_top = float(max(r[4].max() for r in rows))
    for index, (axis_row, (image, pixel, maps, label, weights)) in enumerate(
        zip(axes, rows, strict=True)
    ):
        ax = axis_row[0]
        ax.imshow(image.detach().cpu().float().numpy(), cmap="gray")
        if p is not None:  # global attention: no neighbourhood to mark
            ax.add_patch(Rectangle((pixel[1] - p / 2, pixel[0] - p / 2), p, p, fill=False,
                                   edgecolor="tab:red", lw=1))  # fmt: skip
        ax.plot(pixel[1], pixel[0], "+", color="tab:red", ms=6)
        ax.set_title("input" if index == 0 else f"{moved} by {u}", fontsize=7)
        for v in range(n):
            ax = axis_row[v + 1]
            shown = ax.imshow(maps[v].detach().cpu().float().numpy(), cmap="viridis", vmin=low,
                              vmax=top)  # fmt: skip
            element = v if label == "v" else group.multiply(result.element, v)
            ax.set_title(f"{label} = {group.describe(element)}", fontsize=6)
        for ax in axis_row[: n + 1]:
            ax.set_xticks([])
            ax.set_yticks([])
        if weights is not None:
            ax = axis_row[n + 1]
            heat = ax.imshow(weights.detach().cpu().float().numpy(), cmap="magma", vmin=g_low,
                             vmax=g_top)  # fmt: skip
            ax.set_title("group layer", fontsize=7)
            ax.set_xlabel("key element m", fontsize=6)
            ax.set_ylabel(f"output {label}", fontsize=6)
            ax.set_xticks(range(n), [str(m) for m in range(n)], fontsize=5)
            ax.set_yticks(range(n), [str(m) for m in range(n)], fontsize=5)
    bar = fig.colorbar(shown, ax=axes[:, 1 : n + 1].ravel().tolist(), shrink=0.8)
    bar.set_label("attention weight", fontsize=6)
    bar.ax.tick_params(labelsize=5)
    if result.group_weights is not None:
        bar = fig.colorbar(heat, ax=axes[:, n + 1].ravel().tolist(), shrink=0.8)
        bar.set_label("weight on m", fontsize=6)
        bar.ax.tick_params(labelsize=5)
    marks = [Line2D([], [], color="tab:red", marker="+", ls="", label="query")]
    if p is not None:
        marks.append(Rectangle((0, 0), 1, 1, fill=False, edgecolor="tab:red",
                               label=f"{p}×{p} neighbourhood"))  # fmt: skip
    fig.legend(handles=marks, loc="outside lower left", fontsize=6, frameon=False, ncol=len(marks))
    heading = f"{group.name} lifting attention per output element v (mean over heads)"
    if u is not None:
        heading += f"; rows 1 and 2 agree to {result.max_difference:.1e}"
    fig.suptitle(f"{title}\n{heading}" if title else heading, fontsize=8)
    return fig


def plot_attention_maps(result: AttentionMaps, path: str | Path, title: str = "") -> Path:
    """Save :func:`attention_figure` of ``result`` as ``path`` (a PNG)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig = attention_figure(result, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def draw_attention(model: nn.Module, image: torch.Tensor, path: str | Path,
                   title: str = "") -> Path | None:  # fmt: skip
    """:func:`plot_attention_maps` of ``model`` for ``image`` ``(1, C, H, W)``, from a float64
    copy on the CPU (the model itself stays as it is); ``None`` for a model without a lifting
    self-attention layer."""
    if lifting_layer(model) is None:
        return None
    probe = copy.deepcopy(model).cpu().to(torch.float64)
    maps = lifting_attention_maps(probe, image.cpu().to(torch.float64))
    return plot_attention_maps(maps, path, title=title)
