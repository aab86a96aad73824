"""1x1 maps over the channel axis as matrix products.

A 1x1 convolution of features ``x`` ``(B, C, *S)`` is one batched matrix product,

    out[b, o, s] = sum_c W[o, c] x[b, c, s] + bias[o],

which is how these modules compute it (one ``baddbmm``, the weight broadcast over the
batch without a copy): torch's convolution path converts its operands to a
blocked layout and back on every call, which at the sizes of these nets costs more than the
product itself. They keep :class:`torch.nn.Conv2d` / :class:`torch.nn.Conv3d`'s parameters
(names, shapes ``(C_out, C, 1, 1[, 1])``, initialisation), so state dicts are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn


def pointwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``(B, C, *S)``, ``weight`` ``(C_out, C, 1, ...)``, ``bias`` ``(C_out,)`` or None
    -> ``(B, C_out, *S)``."""
    b, c = x.shape[:2]
    flat = x.reshape(b, c, -1)  # (B, C, S)
    w = weight.reshape(weight.shape[0], c).expand(b, -1, -1)  # (B, C_out, C), no copy
    if bias is None:
        out = torch.bmm(w, flat)
    else:  # the bias broadcast into the product's output, not added in a second pass
        out = torch.baddbmm(bias[:, None].expand(b, -1, flat.shape[2]), w, flat)
    return out.reshape(b, -1, *x.shape[2:])


class Pointwise2d(nn.Conv2d):
    """A 1x1 :class:`torch.nn.Conv2d` computed as a matrix product (:func:`pointwise`)."""

    def __init__(self, in_channels: int, out_channels: int, bias: bool = True) -> None:
        super().__init__(in_channels, out_channels, 1, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return pointwise(x, self.weight, self.bias)


class Pointwise3d(nn.Conv3d):
    """A 1x1x1 :class:`torch.nn.Conv3d` computed as a matrix product (:func:`pointwise`)."""

    def __init__(self, in_channels: int, out_channels: int, bias: bool = True) -> None:
        super().__init__(in_channels, out_channels, 1, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return pointwise(x, self.weight, self.bias)
