"""One row of equivariance evidence, and how a row earns its verdict.

Every check in :mod:`symattn_cli.verify` reduces to rows of :class:`Check`: which symmetry,
which layer or model, which group element, the measured maximum absolute and relative error,
and what was expected:

* ``exact``: the law holds in exact arithmetic; the error must stay under the dtype's
  tolerance (float64: 1e-10), else the row FAILS;
* ``approximate``: the law only holds up to interpolation (45° or 30° rotations of a pixel
  grid); the error is measured and reported (verdict ``measured``), or compared against an
  explicit, labelled ``bound`` when one is given;
* ``violation``: a negative control (a layer built to break the law); its error must be
  clearly large (> 1e-3), else the check could not have failed and the row FAILS;
* ``responds``: non-degeneracy, the second law; the output must change (relative change
  >= 1e-6) under a move the symmetry does not fix (a group layer's input moved along its group
  axis alone), else the layer is blind to it and the row FAILS;
* ``blind``: a layer known to be blind to such a move, reported as a control: its change must
  stay under the dtype's tolerance (verdict ``blind as expected``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

TOLERANCE = {"float64": 1e-10, "float32": 1e-4}
CLEAR_VIOLATION = 1e-3
RESPONSE = 1e-6
EXPECTATIONS = ("exact", "approximate", "violation", "responds", "blind")


@dataclass
class Check:
    family: str  # gsa | attention | knowledge | checkpoint
    symmetry: str  # e.g. "r8", "translation", "O(d)", "permutation XP"
    layer: str  # lifting | group-sum | group-single | block | model | ...
    element: str  # group element or transformation, e.g. "rot90", "rot45*mirror"
    abs_err: float
    rel_err: float
    expect: str = "exact"
    dtype: str = "float64"
    bound: float | None = None  # overrides the dtype tolerance (approximate rows)
    note: str = ""
    verdict: str = field(init=False, default="")

    def __post_init__(self) -> None:
        if self.expect not in EXPECTATIONS:
            raise ValueError(f"expect={self.expect!r}; use one of {EXPECTATIONS}")
        self.verdict = self.judge()

    @property
    def tolerance(self) -> float:
        """The threshold of the verdict; NaN for approximate rows, which are only measured."""
        if self.bound is not None:
            return self.bound
        if self.expect == "violation":
            return CLEAR_VIOLATION
        if self.expect == "responds":
            return RESPONSE
        if self.expect == "approximate":
            return math.nan
        return TOLERANCE[self.dtype]

    def judge(self) -> str:
        if self.expect == "violation":
            return "fails as expected" if self.rel_err > self.tolerance else "FAIL"
        if self.expect == "responds":
            return "responds" if self.rel_err >= self.tolerance else "FAIL"
        if self.expect == "blind":
            return "blind as expected" if self.rel_err <= self.tolerance else "FAIL"
        if self.expect == "approximate":
            if self.bound is None:
                return "measured"
            return "approximate" if self.rel_err <= self.bound else "FAIL"
        return "pass" if self.rel_err <= self.tolerance else "FAIL"

    @property
    def failed(self) -> bool:
        return self.verdict == "FAIL"

    def row(self) -> dict[str, object]:
        out = asdict(self)
        out["tolerance"] = self.tolerance
        out.pop("bound")
        return out
