"""Symmetry groups as objects (pure maths): ``get_group(name)`` resolves config names.

Names: ``z2`` (identity only), ``z4`` (alias ``r4``), ``r8``, ``r12``, ``r16`` (rotations by
360/n degrees), ``mirror`` (alias ``z2m``: the left-right flip), ``z4m`` (alias ``r4m``), ``r8m``
(dihedral: rotations and the left-right flip).
"""

from __future__ import annotations

from functools import cache

from symattn_cli.errors import ConfigError
from symattn_cli.groups.base import GridActionError, Group, grid_coordinates, translate

__all__ = [
    "GROUP_NAMES",
    "GROUP_ALIASES",
    "Group",
    "GridActionError",
    "canonical_group_name",
    "get_group",
    "grid_coordinates",
    "group_option",
    "translate",
]

# canonical name -> (rotations, reflection)
_DEFINITIONS: dict[str, tuple[int, bool]] = {
    "z2": (1, False),
    "z4": (4, False),
    "r8": (8, False),
    "r12": (12, False),
    "r16": (16, False),
    "mirror": (1, True),
    "z4m": (4, True),
    "r8m": (8, True),
}
GROUP_ALIASES: dict[str, str] = {"r4": "z4", "z2m": "mirror", "r4m": "z4m"}
GROUP_NAMES: list[str] = list(_DEFINITIONS)


def canonical_group_name(name: str) -> str:
    """The canonical spelling of a group name or alias; ``ValueError`` for unknown names."""
    key = str(name).strip().lower()
    key = GROUP_ALIASES.get(key, key)
    if key not in _DEFINITIONS:
        valid = ", ".join(GROUP_NAMES + [f"{a} (= {c})" for a, c in GROUP_ALIASES.items()])
        raise ValueError(f"unknown group {name!r}; choose one of: {valid}")
    return key


def group_option(name: str) -> str:
    """:func:`canonical_group_name` for a command's ``groups`` option: an unknown name is a
    :class:`~symattn_cli.errors.ConfigError` naming the option and the choices."""
    try:
        return canonical_group_name(name)
    except ValueError as err:
        raise ConfigError(f"groups: {err}") from None


@cache
def _build(canonical: str) -> Group:
    rotations, reflection = _DEFINITIONS[canonical]
    return Group(name=canonical, rotations=rotations, reflection=reflection)


def get_group(name: str) -> Group:
    """The (shared) :class:`Group` for ``name``; aliases return the same object.

    Names: ``z2`` (identity only), ``z4`` (alias ``r4``), ``r8``, ``r12``, ``r16`` (rotations
    by 360/n degrees), ``mirror`` (alias ``z2m``: the left-right flip), ``z4m`` (alias
    ``r4m``), ``r8m`` (rotations and the flip). An unknown name is a ``ValueError`` listing
    these. Elements exact on a pixel grid: every element of z2, z4, mirror and z4m; in r8,
    r12, r16 and r8m the multiples of 90 degrees (and their flips in r8m).

    Shapes (B batch, C channels, N = |H|, H/W height/width): the group acts on images
    ``(..., H, W)`` by ``(L_g f)(x) = f(u^-1 (x - t))`` and on group features
    ``(B, C, N, H, W)`` by ``(L_g f)(x, h) = f(u^-1 (x - t), u^-1 h)``.
    """
    return _build(canonical_group_name(name))
