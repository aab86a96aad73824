"""The profile's arithmetic: raw intervals nested into spans, and seconds charged per part."""

from __future__ import annotations

import pytest

from symattn_cli.train.profile import PARTS, charge, nest


def test_intervals_nest_by_time_and_parts_take_own_time():
    ns = 1_000_000_000
    intervals = [  # (name, start, end) in ns, unordered as a profiler may give them
        ("train.optimizer", 100 * ns, 150 * ns),
        ("aten::conv2d", 10 * ns, 40 * ns),
        ("train.forward", 0, 100 * ns),
        ("aten::convolution", 12 * ns, 39 * ns),
        ("gsa.kernel.forward", 50 * ns, 90 * ns),
        ("aten::inside_the_kernel", 60 * ns, 70 * ns),
        ("aten::add_", 110 * ns, 120 * ns),
        ("aten::copy_", 150 * ns, 160 * ns),  # starts as the optimizer ends: not inside it
    ]
    roots = nest(intervals)
    assert [r.name for r in roots] == ["train.forward", "train.optimizer", "aten::copy_"]
    assert [c.name for c in roots[0].children] == ["aten::conv2d", "gsa.kernel.forward"]
    parts = charge(roots)
    assert set(parts) == set(PARTS)
    assert parts["attention kernel forward"] == pytest.approx(40)  # whole, children included
    assert parts["1x1 projections"] == pytest.approx(30)
    assert parts["other step operators"] == pytest.approx(30)  # the forward's own time
    assert parts["optimizer"] == pytest.approx(50)
    assert parts["setup, test and figures"] == pytest.approx(10)  # outside every phase
    assert sum(parts.values()) == pytest.approx(160)


def test_the_profile_times_the_block_not_the_profiler_stopping(tmp_path, monkeypatch):
    """The wall time in profile.md is the profiled block's: collecting the profiler's events
    when it stops (long after a run's million of them) is not charged to the run."""
    import time

    import torch.profiler

    from symattn_cli.train import profile as profile_module

    real = torch.profiler.profile

    class SlowStop:  # the profiler, with a stop that takes 0.5 s
        def __init__(self, *args, **kwargs):
            self.inner = real(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self.inner

        def __exit__(self, *exc):
            time.sleep(0.5)
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(torch.profiler, "profile", SlowStop)
    begun = time.perf_counter()
    with profile_module.profiled(tmp_path, enabled=True):
        time.sleep(0.1)
    assert time.perf_counter() - begun >= 0.6
    text = (tmp_path / "profile.md").read_text()
    wall = float(text.split("wall ")[1].split(" s")[0])
    assert 0.09 <= wall < 0.4
