"""Verdicts: exact rows must stay under the dtype tolerance; negative controls must fail."""

from __future__ import annotations

import math

from symattn_cli.verify.records import Check


def test_exact_rows_use_the_dtype_tolerance():
    assert Check("gsa", "r4", "lifting", "rot90", 1e-15, 1e-15).verdict == "pass"
    assert Check("gsa", "r4", "lifting", "rot90", 1e-6, 1e-6).verdict == "FAIL"
    assert Check("gsa", "r4", "lifting", "rot90", 1e-6, 1e-6, dtype="float32").verdict == "pass"


def test_negative_controls_must_fail_clearly():
    assert Check("gsa", "r4", "x", "e", 0.2, 0.2, "violation").verdict == "fails as expected"
    assert Check("gsa", "r4", "x", "e", 1e-9, 1e-9, "violation").verdict == "FAIL"


def test_approximate_rows_are_measured_or_bounded():
    row = Check("gsa", "r8", "lifting · off-grid", "rot45", 0.03, 0.03, "approximate")
    assert row.verdict == "measured" and math.isnan(row.tolerance)
    bounded = Check("gsa", "r8", "x", "rot45", 0.03, 0.03, "approximate", bound=0.01)
    assert bounded.verdict == "FAIL"
