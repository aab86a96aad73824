"""P4CNN-style group convolutional baseline (Cohen & Welling 2016), on any grid-exact group.

Letters: B batch, C channels, N = |H|, H/W height/width, k kernel side, K classes.
Layout ``(B, C, N, H, W)``. Both convolutions satisfy ``conv(L_g f) = L_g conv(f)`` with
``(L_g f)(x, h) = f(u^-1 (x - t), u^-1 h)`` exactly, for every u that maps the pixel grid onto
itself (quarter turns, reflections): their filters are the transformed copies
``(L_u W)(h, y) = W(u^-1 h, u^-1 y)``, one per output element u.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from symattn_cli.groups import Group, get_group
from symattn_cli.models.cnn import check_layers, check_pools, input_pooling
from symattn_cli.nn.pooling import GroupPool


def _check_grid_group(group: Group) -> None:
    bad = [group.describe(e) for e in group.elements if not group.is_grid_exact(e)]
    if bad:
        raise ValueError(
            f"group convolutions on a pixel grid need quarter turns / reflections only; "
            f"{group.name} has {bad[:3]}...; use z2, z4, mirror or z4m"
        )


class LiftingConv(nn.Module):
    """``(B, C_in, H, W) -> (B, C_out, N, H, W)``: correlation with the N transformed filters."""

    def __init__(self, *, group: Group, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__()
        _check_grid_group(group)
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kernel_size, kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.bias = nn.Parameter(torch.zeros(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c_out, n = self.weight.shape[0], self.group.order
        filters = torch.stack(
            [self.group.act_on_grid(u, self.weight) for u in self.group.elements], dim=1
        )  # (C_out, N, C_in, k, k)
        filters = filters.reshape(c_out * n, *self.weight.shape[1:])  # (C_out*N, C_in, k, k)
        out = F.conv2d(x, filters, padding=self.weight.shape[-1] // 2)  # (B, C_out*N, H, W)
        out = out.view(x.shape[0], c_out, n, *out.shape[-2:])  # (B, C_out, N, H, W)
        return out + self.bias[:, None, None, None]


class GroupConv(nn.Module):
    """``(B, C_in, N, H, W) -> (B, C_out, N, H, W)``: filters on the group, one copy per u."""

    def __init__(self, *, group: Group, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__()
        _check_grid_group(group)
        self.group = group
        n = group.order
        self.weight = nn.Parameter(
            torch.empty(out_channels, in_channels, n, kernel_size, kernel_size)
        )
        nn.init.kaiming_uniform_(self.weight.view(out_channels, -1, kernel_size), a=math.sqrt(5))
        self.bias = nn.Parameter(torch.zeros(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c_out, c_in, n, k, _ = self.weight.shape
        filters = torch.stack(
            [self.group.act_on_group_function(u, self.weight) for u in self.group.elements], dim=1
        )  # (C_out, N_out, C_in, N_in, k, k)
        filters = filters.reshape(c_out * n, c_in * n, k, k)  # (C_out*N, C_in*N, k, k)
        b, _, _, height, width = x.shape
        out = F.conv2d(x.reshape(b, c_in * n, height, width), filters, padding=k // 2)
        out = out.view(b, c_out, n, height, width)  # (B, C_out, N, H, W)
        return out + self.bias[:, None, None, None]


class GroupCNN(nn.Module):
    """Optional input average-pooling, lifting conv, group convs with BatchNorm3d + ReLU, 2x2
    max-pools, invariant logits. A ``input_pool`` x ``input_pool`` average pooling commutes
    with the grid-exact elements when it divides the image side, so invariance stays exact."""

    def __init__(
        self,
        *,
        group: Group,
        in_channels: int,
        num_classes: int,
        channels: Sequence[int] = (10, 10, 10, 10, 10, 10, 10),
        kernel_size: int = 3,
        pool_after: Sequence[int] = (1,),
        dropout: float = 0.3,
        input_pool: int = 1,
    ) -> None:
        super().__init__()
        check_layers(channels, kernel_size, pool_after)
        self.group = group
        self.input_pool = input_pooling(input_pool)
        layers: list[nn.Module] = []
        width = in_channels
        for i, out in enumerate(channels):
            conv = LiftingConv if i == 0 else GroupConv
            layers += [
                conv(group=group, in_channels=width, out_channels=out, kernel_size=kernel_size),
                nn.BatchNorm3d(out),
                nn.ReLU(inplace=True),
            ]
            if i in pool_after:
                layers += [nn.MaxPool3d((1, 2, 2)), nn.Dropout(dropout)]
            width = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Conv3d(width, num_classes, 1)
        self.pool = GroupPool(reduction="max", spatial="mean")  # (B, K, N, H', W') -> (B, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.head(self.features(self.input_pool(x)))  # (B, K, N, H', W')
        return self.pool(h)  # (B, K): invariant logits


def build(
    *,
    in_channels: int,
    num_classes: int,
    group: str = "z4",
    channels: Sequence[int] = (10,) * 7,
    kernel_size: int = 3,
    pool_after: Sequence[int] = (1,),
    dropout: float = 0.3,
    input_pool: int = 1,
    image_size: int = 0,
) -> GroupCNN:
    """``_target_`` of the P4CNN configs: the :class:`GroupCNN` on ``group``, with its poolings
    checked against the data's ``image_size`` (0: not checked)."""
    model = GroupCNN(group=get_group(group), in_channels=in_channels, num_classes=num_classes,
                     channels=tuple(channels), kernel_size=kernel_size,
                     pool_after=tuple(pool_after), dropout=dropout,
                     input_pool=input_pool)  # fmt: skip
    check_pools(pool_after, image_size, input_pool)
    return model
