"""Relative positional encodings on continuous coordinates (GSA-Nets Sec. 5.1, App. F).

Letters: V output group elements, J neighbours (P*P offsets, or all points), I query points,
E embedding channels, N = |H|.

The spatial encoding rho_xy is a pair of small MLPs, one on the y (row) and one on the x
(column) component of a normalised offset. Because it is a function on R^2, the group acts on
its argument exactly, ``(L_v rho)(dx) = rho(v^-1 dx)``, for any angle (45, 30 degrees ...),
with no interpolation of a lookup table (the paper's steerability argument).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Swish(nn.Module):
    """``x * sigmoid(x)`` (Ramachandran et al. 2017), the activation used throughout GSA-Nets.

    Computed by ``F.silu``, the same function in one pass, which keeps only ``x`` for the
    backward (``x * torch.sigmoid(x)`` keeps ``x`` and ``sigmoid(x)``).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)


def coordinate_mlp(out_features: int, hidden: int = 16) -> nn.Sequential:
    """1 -> hidden -> GroupNorm(1, hidden) -> Swish -> out_features, on ``(n, 1)`` inputs."""
    return nn.Sequential(
        nn.Linear(1, hidden),
        nn.GroupNorm(1, hidden),
        Swish(),
        nn.Linear(hidden, out_features),
    )


class RelativePositionEncoding(nn.Module):
    """rho_xy(dx) = [row_mlp(dy / s), col_mlp(dx / s)], an ``E = 2 * dim_per_axis`` vector.

    ``forward(offsets, matrices)`` evaluates ``rho_xy(v^-1 dx)`` for every acting matrix:
    offsets ``(..., 2)`` in (x, y) pixel units and ``matrices`` ``(V, 2, 2)`` of the elements
    ``v^-1`` give ``(V, ..., E)``.
    """

    def __init__(self, *, dim_per_axis: int, hidden: int = 16) -> None:
        super().__init__()
        if dim_per_axis < 1:
            raise ValueError(f"dim_per_axis={dim_per_axis} must be >= 1 (head_dim too small)")
        self.dim_per_axis = dim_per_axis
        self.row = coordinate_mlp(dim_per_axis, hidden)
        self.col = coordinate_mlp(dim_per_axis, hidden)

    @property
    def dim(self) -> int:
        return 2 * self.dim_per_axis

    def forward(self, offsets: torch.Tensor, matrices: torch.Tensor, scale: float) -> torch.Tensor:
        return self.encode(*self.arguments(offsets, matrices, scale))

    @staticmethod
    def arguments(
        offsets: torch.Tensor, matrices: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """The MLPs' inputs, ``v^-1 dx / s`` for every matrix: its y and x components as
        ``(2, V*n, 1)`` (rows' MLP first), and the encoding's leading shape ``(V, ...)``.
        They depend on no parameter, so a layer computes them once per geometry."""
        acted = torch.einsum("vab,nb->vna", matrices, offsets.reshape(-1, 2)) / scale  # (V, n, 2)
        columns = torch.stack([acted[..., 1].reshape(-1, 1), acted[..., 0].reshape(-1, 1)])
        return columns, (matrices.shape[0], *offsets.shape[:-1])

    def encode(self, columns: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """``(2, V*n, 1)`` inputs from :meth:`arguments` -> rho_xy ``(*shape, E)``."""
        enc = torch.cat([self.row(columns[0]), self.col(columns[1])], dim=-1)  # (V*n, E)
        return enc.reshape(*shape, self.dim)  # (V, ..., E)
