"""Pooling over the group axis of group features (GSA-Nets Sec. 5, App. F: the invariant head).

Letters: B batch, C channels, N = |H| group elements, H/W height/width. Group features are
``(B, C, N, H, W)``.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP_REDUCTIONS = ("max", "mean")
SPATIAL_REDUCTIONS = (None, "mean", "max")


def _reduce(x: torch.Tensor, how: str, dims: int | tuple[int, ...]) -> torch.Tensor:
    return x.amax(dim=dims) if how == "max" else x.mean(dim=dims)


class GroupPool(nn.Module):
    """Pools group features over the group axis, after pooling over space if ``spatial`` is set.

    Computes ``out(x) = red_h f(x, h)``. With ``spatial`` it computes
    ``out = red_h red_x f(x, h)``, a vector for each sample. The spatial pooling comes first,
    as in the shipped GSA-Net's logits (a mean over space, then a max over the group axis):
    the max of the means is not the mean of the maxes.

    Shapes (B batch, C channels, N = |H|, H/W height/width; the group axis is axis 2):
        ``spatial=None``: ``(B, C, N, H, W) -> (B, C, H, W)``; any ``(B, C, N, *S) ->
        (B, C, *S)``.
        ``spatial="mean"`` or ``"max"``: ``(B, C, N, H, W) -> (B, C)``.

    Group action: for ``(L_g f)(x, h) = f(u^-1 (x - t), u^-1 h)``, h -> u^-1 h permutes the
    group axis, and a max or a mean over that axis does not depend on the order. So
    ``pool(L_g f) = L_g pool(f)``, where g acts on the output as on an image,
    ``(L_g o)(x) = o(u^-1 (x - t))``. With ``spatial`` the output does not change at all,
    ``pool(L_g f) = pool(f)``, for every u that maps the pixel grid onto itself (multiples of
    90 degrees, the flip), which only permutes the pixels. Translations give the same
    invariance only when nothing crosses the border.

    Options:
        ``reduction``: ``"max"`` (default) or ``"mean"``, taken over the group axis.
        ``spatial``: ``None`` (default: space is kept), ``"mean"`` or ``"max"``, taken over
        (H, W) before the group axis is pooled.
    """

    def __init__(self, *, reduction: str = "max", spatial: str | None = None) -> None:
        super().__init__()
        if reduction not in GROUP_REDUCTIONS:
            raise ValueError(f"reduction={reduction!r}; choose one of {GROUP_REDUCTIONS}")
        if spatial not in SPATIAL_REDUCTIONS:
            raise ValueError(f"spatial={spatial!r}; choose one of {SPATIAL_REDUCTIONS}")
        self.reduction = reduction
        self.spatial = spatial

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 3 or (self.spatial is not None and x.dim() != 5):
            want = "(B, C, N, H, W)" if self.spatial is not None else "(B, C, N, ...)"
            raise ValueError(f"GroupPool expects group features {want}, got {tuple(x.shape)}")
        if self.spatial is not None:
            x = _reduce(x, self.spatial, (-2, -1))  # (B, C, N)
        return _reduce(x, self.reduction, 2)  # (B, C, *S)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, spatial={self.spatial!r}"
