"""Finite subgroups H of O(2) acting on the plane, on themselves and on pixel grids.

A group element u is stored as an index ``e = s * n + k`` meaning ``u = R^k M^s``: a rotation
by ``k * 360/n`` degrees after an optional reflection ``M: (x, y) -> (-x, y)``, the left-right
flip of an image (the horizontal flip of data augmentation, a symmetry of natural images).
Because ``M R_theta = R_{-theta} M``, composition is
``(k1, s1)(k2, s2) = (k1 + (-1)^s1 k2, s1 + s2)``.

Letters: B batch, C channels, N = |H| group elements, H/W image height/width (rows/columns),
I points, P patch side.

Coordinate convention (pinned in :func:`grid_coordinates`, used everywhere): a pixel at
(row r, column c) of an H x W grid has coordinates ``x = c - (W - 1) / 2`` (to the right) and
``y = (H - 1) / 2 - r`` (upwards), so the origin is the image centre and a positive angle turns
counter-clockwise as the image is displayed (row 0 at the top).

Transformation laws, for g = (t, u) in G = R^2 x| H:
    images           (L_g f)(x)    = f(u^-1 (x - t))
    group functions  (L_g f)(x, h) = f(u^-1 (x - t), u^-1 h)        (GSA-Nets Sec. 5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class GridActionError(ValueError):
    """The group element does not map the pixel grid onto itself (e.g. a 45 degree turn)."""


def grid_coordinates(height: int, width: int, dtype=torch.float64, device=None) -> torch.Tensor:
    """(x, y) coordinates of the pixel centres of an ``height x width`` grid, ``(H, W, 2)``,
    on ``device`` (torch's default device when None, as for torch's own constructors).

    The single place where the coordinate convention is fixed: x runs along columns to the
    right, y along rows upwards, origin at the grid centre (half-integers for even sizes).
    """
    rows = torch.arange(height, dtype=dtype, device=device)
    cols = torch.arange(width, dtype=dtype, device=device)
    y = (height - 1) / 2 - rows  # (H,)
    x = cols - (width - 1) / 2  # (W,)
    return torch.stack(torch.broadcast_tensors(x[None, :], y[:, None]), dim=-1)  # (H, W, 2)


@dataclass(frozen=True, eq=True)
class Group:
    """The rotation group C_n (``reflection=False``) or the dihedral group D_n (``True``), the
    point group H of G = R^2 x| H.

    Elements are indices ``e = s * n + k`` for ``u = R^k M^s`` (0 is the identity), with
    R the turn by 360/n degrees and M the left-right flip; ``(k1, s1)(k2, s2) = (k1 + (-1)^s1
    k2, s1 + s2)`` (:meth:`multiply`, :attr:`cayley`, :attr:`inverse`).

    Shapes (B batch, C channels, N = |H| = :attr:`order`, H/W height/width):
    :attr:`cayley` ``(N, N)``, :meth:`matrices` ``(N, 2, 2)``, :meth:`regular_permutation`
    ``(N,)``; :meth:`act_on_image` takes and returns ``(..., H, W)``,
    :meth:`act_on_group_function` ``(B, C, N, H, W)``.

    Group action, for g = (t, u): on images ``(L_g f)(x) = f(u^-1 (x - t))``, on group
    features ``(L_g f)(x, h) = f(u^-1 (x - t), u^-1 h)``, with t an integer shift applied
    cyclically. On a pixel grid only the elements of :meth:`grid_exact_elements` act exactly
    (multiples of 90 degrees, with or without the flip); the others raise
    :class:`GridActionError` there and act exactly on point coordinates
    (:meth:`act_on_coordinates`).

    Options: ``name`` (a label); ``rotations`` n >= 1; ``reflection`` False (default) or
    True. :func:`~symattn_cli.groups.get_group` returns the named, shared instances.
    """

    name: str
    rotations: int
    reflection: bool = False

    def __post_init__(self) -> None:
        if self.rotations < 1:
            raise ValueError(f"rotations={self.rotations} must be a positive integer")
        # The tables, built once, as plain attributes: torch.compile reads them as constants
        # (a cached property takes a lock it cannot trace).
        object.__setattr__(self, "_tables", {})
        for name in ("cayley", "inverse", "relative", "_matrices64"):
            self._tables[name] = getattr(self, f"_build{name if name[0] == '_' else '_' + name}")()

    # ------------------------------------------------------------------ elements
    @property
    def order(self) -> int:
        """N = |H|."""
        return self.rotations * (2 if self.reflection else 1)

    @property
    def elements(self) -> range:
        """Element indices 0..N-1; index ``s * n + k`` is ``R^k M^s``; 0 is the identity."""
        return range(self.order)

    @property
    def identity(self) -> int:
        return 0

    def decompose(self, e: int) -> tuple[int, int]:
        """``(k, s)`` with ``u = R^k M^s``."""
        self._check(e)
        return e % self.rotations, e // self.rotations

    def compose_index(self, k: int, s: int) -> int:
        return (s % 2) * self.rotations + k % self.rotations

    def angle(self, e: int) -> float:
        """Rotation angle of element ``e`` in radians (after the reflection, if any)."""
        k, _ = self.decompose(e)
        return 2 * math.pi * k / self.rotations

    def is_reflection(self, e: int) -> bool:
        return self.decompose(e)[1] == 1

    def describe(self, e: int) -> str:
        k, s = self.decompose(e)
        deg = 360 * k / self.rotations
        return f"rot{deg:g}" + ("*mirror" if s else "")

    # ------------------------------------------------------------------ structure
    def multiply(self, a: int, b: int) -> int:
        """Index of the product ``a b`` (apply b first, then a)."""
        k1, s1 = self.decompose(a)
        k2, s2 = self.decompose(b)
        return self.compose_index(k1 + (-1) ** s1 * k2, s1 + s2)

    def invert(self, a: int) -> int:
        k, s = self.decompose(a)
        return a if s else self.compose_index(-k, 0)

    # The tables are CPU tensors, built once. Indexing a tensor on another device with them is
    # fine (torch moves the index); ``device="cpu"`` is explicit so that a table first built
    # under another default device (``with torch.device(...)``) is not cached there.
    @property
    def cayley(self) -> torch.Tensor:
        """``(N, N)`` long tensor, ``cayley[a, b]`` = index of ``a b``."""
        return self._tables["cayley"]

    @property
    def inverse(self) -> torch.Tensor:
        """``(N,)`` long tensor, ``inverse[a]`` = index of ``a^-1``."""
        return self._tables["inverse"]

    @property
    def relative(self) -> torch.Tensor:
        """``(N, N)`` long tensor ``relative[g, m]`` = index of ``g^-1 m``.

        Invariant under ``(g, m) -> (u g, u m)``: the argument of the group positional
        encoding that makes group self-attention exactly equivariant.
        """
        return self._tables["relative"]

    @property
    def _matrices64(self) -> torch.Tensor:
        return self._tables["_matrices64"]

    def _build_cayley(self) -> torch.Tensor:
        n = self.order
        rows = [[self.multiply(a, b) for b in range(n)] for a in range(n)]
        return torch.tensor(rows, device="cpu")

    def _build_inverse(self) -> torch.Tensor:
        return torch.tensor([self.invert(a) for a in range(self.order)], device="cpu")

    def _build_relative(self) -> torch.Tensor:
        return self.cayley[self.inverse]  # (N, N): row g is g^-1 composed with every m

    # ------------------------------------------------------------------ actions
    def _build_matrices64(self) -> torch.Tensor:
        """``(N, 2, 2)`` float64 on the CPU: ``R^k M^s`` with M = diag(-1, 1), so each entry
        is +-cos or +-sin of the angle, exactly, and casting to another dtype rounds each
        entry once, as building it in that dtype would."""
        rows = []
        for e in self.elements:
            k, s = self.decompose(e)
            if self.rotations % 4 == 0 and k % (self.rotations // 4) == 0:
                q = k // (self.rotations // 4)  # exact quarter turns, no rounding error
                c, si = [(1.0, 0.0), (0.0, 1.0), (-1.0, 0.0), (0.0, -1.0)][q]
            else:
                theta = 2 * math.pi * k / self.rotations
                c, si = math.cos(theta), math.sin(theta)
            m = -1.0 if s else 1.0  # R M: the first column of R times m
            rows.append([[c * m, -si], [si * m, c]])
        return torch.tensor(rows, dtype=torch.float64, device="cpu") + 0.0  # -0 -> +0, as R @ M

    def matrix(self, e: int, dtype=torch.float64, device=None) -> torch.Tensor:
        """The 2x2 matrix of ``u = R^k M^s`` acting on (x, y) column vectors."""
        self._check(e)
        return self._matrices64[e].to(device=_device(device), dtype=dtype, copy=True)

    def matrices(self, dtype=torch.float64, device=None) -> torch.Tensor:
        """``(N, 2, 2)``: all elements as matrices, a new tensor on ``device`` (torch's default
        device when None)."""
        return self._matrices64.to(device=_device(device), dtype=dtype, copy=True)

    def act_on_coordinates(self, e: int, coords: torch.Tensor) -> torch.Tensor:
        """``u x`` for points ``coords`` of shape ``(..., 2)`` in (x, y) order."""
        return coords @ self.matrix(e, coords.dtype, coords.device).T  # (..., 2)

    def regular_permutation(self, e: int, device=None) -> torch.Tensor:
        """Index map ``perm`` with ``(L_u f)(h) = f(u^-1 h)`` equal to ``f[..., perm]``, on
        ``device`` (torch's default device when None): ``perm[h] = u^-1 h``, row u of
        :attr:`relative`.

        The regular representation of u as a permutation of the group axis.
        """
        self._check(e)
        return self.relative[e].to(device=_device(device), copy=True)

    def is_grid_exact(self, e: int) -> bool:
        """Whether ``u`` maps a square pixel grid onto itself (multiples of 90 degrees)."""
        k, _ = self.decompose(e)
        return (4 * k) % self.rotations == 0

    def grid_exact_elements(self) -> list[int]:
        return [e for e in self.elements if self.is_grid_exact(e)]

    def act_on_grid(self, e: int, f: torch.Tensor) -> torch.Tensor:
        """``(L_u f)(x) = f(u^-1 x)`` on the last two (row, column) axes, exactly.

        Raises :class:`GridActionError` for angles that are not multiples of 90 degrees, and
        for quarter turns of non-square grids.
        """
        k, s = self.decompose(e)
        if not self.is_grid_exact(e):
            raise GridActionError(
                f"{self.name} element {self.describe(e)} does not map pixels onto pixels; "
                "only multiples of 90 degrees and reflections act exactly on a grid "
                "(interpolate, or rotate point coordinates instead)"
            )
        quarter = (4 * k) // self.rotations
        if quarter % 2 and f.shape[-1] != f.shape[-2]:
            raise GridActionError(f"a quarter turn needs a square grid, got {tuple(f.shape[-2:])}")
        if s:
            f = torch.flip(f, dims=(-1,))  # M: x -> -x flips the columns (left-right)
        # rot90 from the row axis towards the column axis turns counter-clockwise as
        # displayed, i.e. by +90 degrees in the (x, y) convention of grid_coordinates.
        return torch.rot90(f, quarter, dims=(-2, -1))

    def act_on_group_function(
        self, e: int, f: torch.Tensor, shift: tuple[int, int] = (0, 0)
    ) -> torch.Tensor:
        """``(L_g f)(x, h) = f(u^-1 (x - t), u^-1 h)`` for ``f`` of shape ``(B, C, N, H, W)``.

        ``shift = (tx, ty)`` is an integer translation t in the (x, y) convention, applied
        cyclically (compare away from the borders).
        """
        if f.dim() != 5 or f.shape[2] != self.order:
            raise ValueError(
                f"expected a group function (B, C, N={self.order}, H, W), got {tuple(f.shape)}"
            )
        out = f[:, :, self.regular_permutation(e, f.device)]  # (B, C, N, H, W)
        out = self.act_on_grid(e, out)
        return translate(out, shift)

    def act_on_image(self, e: int, f: torch.Tensor, shift: tuple[int, int] = (0, 0)):
        """``(L_g f)(x) = f(u^-1 (x - t))`` for images ``(..., H, W)``."""
        return translate(self.act_on_grid(e, f), shift)

    def _check(self, e: int) -> None:
        if not 0 <= e < self.order:
            raise IndexError(f"{self.name} has elements 0..{self.order - 1}, got {e}")

    def __repr__(self) -> str:
        return f"Group({self.name!r}, order={self.order})"


def _device(device) -> torch.device:
    """``device``, or torch's default device (``torch.set_default_device``, ``with
    torch.device(...)``) when None: what torch's constructors do with ``device=None``."""
    return torch.get_default_device() if device is None else torch.device(device)


def translate(f: torch.Tensor, shift: tuple[int, int]) -> torch.Tensor:
    """``(L_t f)(x) = f(x - t)`` for an integer ``t = (tx, ty)``, cyclic on the last two axes."""
    tx, ty = shift
    if tx == 0 and ty == 0:
        return f
    return torch.roll(f, shifts=(-ty, tx), dims=(-2, -1))  # y is up: rows move by -ty
