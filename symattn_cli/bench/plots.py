"""Benchmark plots: time and peak memory against group order N and neighbourhood side P.

Each figure has two panels (time, memory), log-log, one line per series of rows (layers or
whole networks) that differ only in the plotted axis (as in
:func:`symattn_cli.bench.suite.growth_exponents`); training steps (forward + backward) solid,
inference (forward) dashed. Written as PNG with the Agg backend, so no display is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from symattn_cli.bench.suite import GLOBAL_P, SERIES_KEYS, shown

AXIS_TITLES = {
    "group_order": ("group order N", "time_memory_vs_group.png"),
    "patch_size": ("neighbourhood side P (global at the right)", "time_memory_vs_patch.png"),
    "image_size": ("image side", "time_memory_vs_side.png"),
}


def _series(rows: Sequence[dict[str, Any]], column: str) -> dict[str, list[dict[str, Any]]]:
    keys = [k for k in SERIES_KEYS if k != column]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("status") == "ok":
            groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    out = {}
    for members in groups.values():
        if len({m[column] for m in members}) < 2:
            continue
        first = members[0]
        fixed = {
            "group_order": f"N={first['group_order']}",
            "patch_size": f"P={shown('patch_size', first['patch_size'])}",
            "image_size": f"{first['image_size']}px",
            "batch": f"b{first['batch']}",
        }
        fixed.pop(column)
        name = f"{first['kind']} {first['family']} {first['form']}"
        if first.get("group_index") and first["form"] == "sum":
            name += f" {first['group_index']}"
        label = f"{name} ({', '.join(fixed.values())})"
        out[label] = members
    return out


def _x(row: dict[str, Any], column: str, global_at: float) -> float:
    value = row[column]
    return global_at if column == "patch_size" and value == GLOBAL_P else value


def plot_axis(rows: Sequence[dict[str, Any]], column: str, path: Path) -> Path | None:
    """One figure for ``column``; ``None`` when no series varies along it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _series(rows, column)
    if not series:
        return None
    sides = [r[column] for members in series.values() for r in members if r[column]]
    global_at = 1.5 * max(sides) if sides else 1.0
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, (label, members) in enumerate(sorted(series.items())):
        members = sorted(members, key=lambda r: _x(r, column, global_at))
        xs = [_x(r, column, global_at) for r in members]
        color = f"C{index % 10}"
        for mode, style in (("train", "-"), ("forward", "--")):
            times = [r.get(f"{mode}_time_s") for r in members]
            if all(t is not None for t in times):
                ax_time.plot(xs, times, style, marker="o", color=color,
                             label=f"{label} {mode}")  # fmt: skip
            mems = [r.get(f"{mode}_mem_mb") for r in members]
            if all(m is not None for m in mems):
                ax_mem.plot(xs, [max(m, 1e-3) for m in mems], style, marker="o", color=color)
    title, _ = AXIS_TITLES[column]
    ticks = sorted({_x(r, column, global_at) for members in series.values() for r in members})
    names = ["global" if column == "patch_size" and t == global_at else f"{t:g}" for t in ticks]
    for ax, ylabel in ((ax_time, "median step time (s)"), (ax_mem, "peak memory growth (MB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(ticks, names)
        ax.minorticks_off()
        ax.set_xlabel(title)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_time.legend(fontsize=6, loc="best")
    ax_mem.set_title("solid: forward+backward, dashed: forward", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(rows: Sequence[dict[str, Any]], directory: Path) -> list[Path]:
    """Every figure that has data, saved in ``directory``; returns the written paths."""
    written = []
    for column, (_, filename) in AXIS_TITLES.items():
        path = plot_axis(rows, column, Path(directory) / filename)
        if path is not None:
            written.append(path)
    return written
