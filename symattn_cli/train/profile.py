"""Where a training run's wall time goes: a profile of the run by part of the training step.

``symattn train trainer.profile=true`` runs under :mod:`torch.profiler` and writes
``profile.md`` next to the run file. The trainer marks its phases with ``record_function``
ranges (``train.data``, ``train.forward``, ``train.backward``, ``train.optimizer``,
``train.logging``, ``train.validation``, ``train.plotting``) and the fused attention kernel
its calls (``gsa.kernel.forward``, ``gsa.kernel.backward``). Each event of the main thread is
charged its self time: a kernel range whole, an operator inside the forward and backward by
its name (1x1 projections, layout copies, norms and activations, the rest of the step), any
other range by the phase it lies in. What no range covers (building the model and data, the
final test, the figures) is ``setup, test and figures``. The CPU time over the wall time says
how many cores were busy on average.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

PROFILE_FILE = "profile.md"
PARTS = (
    "attention kernel forward",
    "attention kernel backward",
    "1x1 projections",
    "layout copies",
    "norms and activations",
    "other step operators",
    "data",
    "optimizer",
    "validation",
    "run file, tracker and progress",
    "plotting",
    "setup, test and figures",
)
_RANGES = {
    "gsa.kernel.forward": "attention kernel forward",
    "gsa.kernel.backward": "attention kernel backward",
    "train.data": "data",
    "train.optimizer": "optimizer",
    "train.validation": "validation",
    "train.logging": "run file, tracker and progress",
    "train.plotting": "plotting",
}
_STEP = ("train.forward", "train.backward")
_COPIES = ("copy", "contiguous", "clone", "permute", "transpose", "reshape", "view", "index",
           "gather", "scatter", "cat", "stack", "movedim", "expand", "slice", "select")  # fmt: skip
# 1x1 maps: matrix products (symattn_cli.nn.pointwise) or convolutions
_PROJECTIONS = ("conv", "bmm", "mm", "matmul", "linear")
_NORMS = ("norm", "silu", "sigmoid", "relu", "gelu", "swish", "pool", "dropout", "softmax")


def _operator_part(name: str) -> str:
    """The part an operator of the forward or backward belongs to, by its name."""
    low = name.lower()
    if any(word in low for word in _PROJECTIONS):
        return "1x1 projections"
    if any(word in low for word in _NORMS):
        return "norms and activations"
    if any(word in low for word in _COPIES):
        return "layout copies"
    return "other step operators"


@dataclass
class Span:
    """One profiled range or operator: its name, start and end (ns), and the spans directly
    inside it on the same thread."""

    name: str
    start: int
    end: int
    children: list[Span] = field(default_factory=list)

    @property
    def total(self) -> float:
        return (self.end - self.start) / 1e9

    @property
    def own(self) -> float:
        """Seconds not covered by a child."""
        return self.total - sum(child.total for child in self.children)


def nest(intervals) -> list[Span]:
    """The top-level spans of ``(name, start_ns, end_ns)`` intervals of one thread, each
    holding the spans nested in it (an interval lies inside the last open one that ends no
    earlier)."""
    roots: list[Span] = []
    open_: list[Span] = []
    for name, start, end in sorted(intervals, key=lambda t: (t[1], -t[2])):
        span = Span(name, start, end)
        while open_ and open_[-1].end < end:
            open_.pop()
        (open_[-1].children if open_ else roots).append(span)
        open_.append(span)
    return roots


def charge(roots: list[Span]) -> dict[str, float]:
    """Seconds per part of :data:`PARTS` from the top-level spans of one thread: a kernel
    range whole, an operator inside the forward and backward by its name, any other span's
    own time by the phase it lies in."""
    out = dict.fromkeys(PARTS, 0.0)

    def walk(span: Span, phase: str | None) -> None:
        name = span.name
        if name in ("gsa.kernel.forward", "gsa.kernel.backward"):
            out[_RANGES[name]] += span.total  # the kernel, whole
            return
        if name in _RANGES:
            phase = _RANGES[name]
        elif name in _STEP:
            phase = "step"
        if phase == "step":
            part = "other step operators" if name in _STEP else _operator_part(name)
        else:
            part = phase or "setup, test and figures"
        out[part] += span.own
        for child in span.children:
            walk(child, phase)

    for root in roots:
        walk(root, None)
    return out


def main_thread_spans(prof) -> list[Span]:
    """The spans of the thread that ran the training loop (the one with the most phase
    ranges), read from the profiler's raw events: seconds for a run's million events, where
    building torch's event objects takes minutes."""
    threads: dict[int, list[tuple[str, int, int]]] = {}
    for event in prof.profiler.kineto_results.events():
        start = event.start_ns()
        threads.setdefault(event.start_thread_id(), []).append(
            (event.name(), start, start + event.duration_ns())
        )
    if not threads:
        return []
    marked = {thread: sum(name in _RANGES or name in _STEP for name, _, _ in intervals)
              for thread, intervals in threads.items()}  # fmt: skip
    return nest(threads[max(marked, key=marked.get)])


@contextmanager
def profiled(directory: Path, *, enabled: bool) -> Iterator[None]:
    """Profile the block when ``enabled``; then print the table and write ``profile.md`` to
    ``directory``."""
    if not enabled:
        yield
        return
    import os

    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # no notes about absent GPUs on stderr

    # the block's own time: stopping the profiler (collecting its events) lies outside it
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        yield
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
    parts = charge(main_thread_spans(prof))
    parts["setup, test and figures"] += max(wall - sum(parts.values()), 0.0)
    text = format_profile(parts, wall, cpu)
    (directory / PROFILE_FILE).write_text(text)
    print(text, flush=True)


def format_profile(parts: dict[str, float], wall: float, cpu: float) -> str:
    """The profile as a Markdown table: seconds and share of the wall time per part."""
    lines = [
        f"**wall {wall:.1f} s, CPU {cpu:.1f} s ({cpu / max(wall, 1e-9):.2f} CPU s per wall s)**",
        "",
        "| part | wall s | share |",
        "|---|---:|---:|",
    ]
    for part in PARTS:
        lines.append(f"| {part} | {parts[part]:.2f} | {parts[part] / max(wall, 1e-9):.1%} |")
    return "\n".join(lines) + "\n"
