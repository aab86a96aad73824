"""A small rotation-invariant classifier built from symattn's public layers."""

from __future__ import annotations

from torch import nn

from symattn_cli.nn import GroupPool, GroupSelfAttention, LiftingSelfAttention, get_group


class TinyGSANet(nn.Module):
    """Images ``(B, in_channels, H, W)`` -> logits ``(B, num_classes)``, invariant to the
    grid-exact elements of ``group``: a lifting layer, one group self-attention layer, each
    followed by a batch norm (statistics over whole orbits) and an activation, then a pooling
    over the group axis and space and a linear head."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        group: str = "r4",
        channels: int = 8,
        heads: int = 2,
        patch_size: int = 3,
    ) -> None:
        super().__init__()
        self.group = get_group(group)
        layer = dict(group=self.group, out_channels=channels, heads=heads, patch_size=patch_size)
        self.features = nn.Sequential(
            LiftingSelfAttention(in_channels=in_channels, **layer),  # (B, C, N, H, W)
            nn.GroupNorm(1, channels),
            nn.SiLU(),
            GroupSelfAttention(in_channels=channels, **layer),  # (B, C, N, H, W)
            nn.GroupNorm(1, channels),
            nn.SiLU(),
            GroupPool(reduction="max", spatial="mean"),  # (B, C)
        )
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x):
        return self.head(self.features(x))
