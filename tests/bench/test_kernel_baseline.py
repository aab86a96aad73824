"""``kernel_baseline=``: the shipped C++ kernel timed against another version of it, step by
step in one process (the plumbing; timings themselves are never asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from symattn_cli.bench.measure import Case, Settings, measure_case
from symattn_cli.nn.gsa import cpp


@pytest.fixture
def kernel():
    module = cpp.load()
    if module is None:
        pytest.skip("the C++ kernel is not built here")
    return module


def test_using_swaps_the_kernel_and_restores_it(kernel):
    stand_in = object()
    with cpp.using(stand_in):
        assert cpp.load() is stand_in
    assert cpp.load() is kernel


def test_the_shipped_source_is_not_built_twice(kernel):
    assert cpp.load_source(cpp.SOURCE) is kernel


def test_a_case_is_timed_against_the_baseline_kernel(kernel, tmp_path: Path):
    case = Case(kind="layer", name="gsa", group="r4", patch_size=3, image_size=6, batch=1,
                channels=8, heads=1)  # fmt: skip
    settings = Settings(repeats=3, warmup=1, threads=1, modes=("train", "forward"),
                        count_flops=False, kernel_baseline=str(cpp.SOURCE))  # fmt: skip
    row = measure_case(case, settings)
    for mode in ("train", "forward"):
        assert row[f"{mode}_baseline_time_s"] > 0
        assert row[f"{mode}_time_vs_baseline"] > 0
    # without the option the row has no baseline columns
    plain = measure_case(case, Settings(repeats=1, warmup=0, threads=1, modes=("train",),
                                        count_flops=False))  # fmt: skip
    assert not any("baseline" in key for key in plain)


def test_a_bad_kernel_baseline_is_one_line_and_exit_2(symattn, workdir: Path):
    result = symattn(
        "benchmark", "preset=quick", "kernel_baseline=no-such-revision", "logger.mode=disabled",
        f"hydra.run.dir={workdir / 'run'}", cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "kernel_baseline='no-such-revision' is neither a file nor a git revision" in lines[0]
    assert "HEAD~1" in lines[0]
    assert not (workdir / "run" / "run.h5").exists()
