"""The verification library returns numbers; exact checks are exact, controls fail."""

from __future__ import annotations

import pytest

from symattn_cli.verify.gsa import (
    offgrid_equivariance,
    pointset_equivariance,
    run_all,
    self_attention_facts,
    summarize,
    translation_equivariance,
)


@pytest.mark.parametrize("kind", ["lifting", "group_sum", "group_single"])
@pytest.mark.parametrize("size", [11, 12])
def test_translation_equivariance_on_the_interior(kind, size):
    (record,) = translation_equivariance("z4", kind, image_size=size)
    assert record["max_rel"] <= 1e-10


@pytest.mark.parametrize("group", ["r8", "r12", "r8m"])
@pytest.mark.parametrize("kind", ["lifting", "group_sum", "group_single"])
def test_pointset_rotations_are_exact_off_grid_too(group, kind):
    records = pointset_equivariance(group, kind)
    assert any("45" in r["element"] or "30" in r["element"] for r in records)
    assert max(r["max_rel"] for r in records) <= 1e-10


@pytest.mark.parametrize("group", ["r8", "r12"])
def test_offgrid_interpolated_error_is_reported_and_bounded(group):
    records = offgrid_equivariance(group)
    assert records and all(r["expected"] == "approximate" for r in records)
    # Loose, labelled bound: bilinear interpolation of a 15x15 smooth image.
    assert max(r["max_rel"] for r in records) < 0.3


def test_self_attention_facts_and_negative_controls():
    records = self_attention_facts()
    for r in records:
        if r["expected"] == "exact":
            assert r["max_rel"] <= 1e-10, r
        else:
            assert r["max_rel"] > 1e-3, r


def test_run_all_returns_records_for_every_group_kind():
    records = run_all(groups=["z4", "mirror"], kinds=["lifting", "group_sum"], image_sizes=(5,))
    rows = summarize(records)
    assert {(r["group"], r["kind"]) for r in rows} >= {("z4", "lifting"), ("mirror", "group_sum")}
    assert all(r["max_rel"] <= 1e-10 for r in rows if r["expected"] == "exact")
