"""Plain CNN baseline: optional input average-pooling, conv-BN-ReLU stages with max-pooling,
global average pool, linear.

Letters: B batch, C channels, H/W height/width, K classes. Translation equivariant in its
convolutions only (pooling breaks it); no rotation symmetry: the reference point the
group-equivariant models are compared against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from symattn_cli.errors import ConfigError


def check_layers(channels: Sequence[int], kernel_size: int, pools: Sequence[int]) -> None:
    """A ValueError naming the option where the convolution layers ``channels`` with filters
    of side ``kernel_size`` and a 2x2 max-pooling after each layer index in ``pools`` cannot
    be built."""
    if not channels or any(c < 1 for c in channels):
        raise ValueError(f"channels={list(channels)}: give one width of at least 1 a layer")
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size={kernel_size} must be odd and positive (same padding)")
    bad = [i for i in pools if not 0 <= i < len(channels)]
    if bad:
        raise ValueError(
            f"pool_after={list(pools)}: {bad} name no layer; layers are 0..{len(channels) - 1}"
        )


def input_pooling(factor: int) -> nn.Module:
    """Average pooling of the input by ``factor`` (1: none), as the GSA-Nets' ``input_pool``;
    no parameters, so a model's parameter count does not depend on it."""
    if factor < 1:
        raise ConfigError(f"input_pool={factor} must be at least 1 (1: no pooling)")
    return nn.AvgPool2d(factor) if factor > 1 else nn.Identity()


def check_pools(pools: Sequence[int], image_size: int, input_pool: int = 1) -> None:
    """A ValueError where the input pooling by ``input_pool`` leaves no pixel or a 2x2
    max-pooling after a layer index in ``pools`` meets a map of one pixel, for square images
    of ``image_size`` pixels (0: unknown, nothing checked)."""
    if not image_size:
        return
    side = image_size // input_pool
    pooled = f", input_pool={input_pool}" if input_pool > 1 else ""
    if side < 1:
        raise ValueError(
            f"input_pool={input_pool} leaves no pixel of {image_size}x{image_size} images; "
            f"use at most {image_size}"
        )
    for i in sorted(set(pools)):
        if side < 2:
            raise ValueError(
                f"the pooling after layer {i} meets a {side}x{side} map ({image_size}x"
                f"{image_size} images{pooled}); use fewer layers or poolings"
                + (" or a lower input_pool" if pooled else "")
            )
        side //= 2


class PlainCNN(nn.Module):
    def __init__(
        self,
        *,
        in_channels: int,
        num_classes: int,
        channels: Sequence[int] = (32, 64, 96),
        kernel_size: int = 3,
        dropout: float = 0.1,
        input_pool: int = 1,
    ) -> None:
        super().__init__()
        check_layers(channels, kernel_size, range(len(channels) - 1))
        self.input_pool = input_pooling(input_pool)
        layers: list[nn.Module] = []
        width = in_channels
        for i, out in enumerate(channels):
            layers += [
                nn.Conv2d(width, out, kernel_size, padding=kernel_size // 2, bias=False),
                nn.BatchNorm2d(out),
                nn.ReLU(inplace=True),
                nn.Conv2d(out, out, kernel_size, padding=kernel_size // 2, bias=False),
                nn.BatchNorm2d(out),
                nn.ReLU(inplace=True),
            ]
            if i < len(channels) - 1:
                layers.append(nn.MaxPool2d(2))
            width = out
        self.features = nn.Sequential(*layers)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(self.input_pool(x))  # (B, C, H', W')
        h = h.mean(dim=(2, 3))  # (B, C)
        return self.head(self.dropout(h))  # (B, K)


def build(
    *,
    in_channels: int,
    num_classes: int,
    channels: Sequence[int] = (32, 64, 96),
    kernel_size: int = 3,
    dropout: float = 0.1,
    input_pool: int = 1,
    image_size: int = 0,
) -> PlainCNN:
    """``_target_`` of the CNN configs: the :class:`PlainCNN`, with its poolings checked
    against the data's ``image_size`` (0: not checked)."""
    model = PlainCNN(in_channels=in_channels, num_classes=num_classes, channels=tuple(channels),
                     kernel_size=kernel_size, dropout=dropout,
                     input_pool=input_pool)  # fmt: skip
    check_pools(range(len(channels) - 1), image_size, input_pool)
    return model
