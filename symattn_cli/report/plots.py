"""The report's plots: each metric per group with error bars, and learning curves overlaid.

``metrics.png``: one panel per metric, a point per group at the mean with a ± std error bar,
each run as a small dot beside it. ``curves.png``: one panel per epoch metric (the validation
score and the training loss by default), a line per group at the mean over its runs with a
± std band. ``trend.png`` (``x=KEY``): each metric against a numeric column, a line per group
of the other columns, mean ± std. ``scatter.png`` (``scatter=[X,Y]``): summary metric Y
against X (test accuracy against training time), a point per group at the means with ± std
error bars along both axes. Agg backend, so no display is needed.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from symattn_cli.report.groups import RunGroup
from symattn_cli.report.tables import header, is_score

METRICS_FILE = "metrics.png"
CURVES_FILE = "curves.png"
TREND_FILE = "trend.png"
SCATTER_FILE = "scatter.png"


def group_name(group: RunGroup) -> str:
    return ", ".join(group.label.values()) or "all runs"


def _colours(count: int) -> list:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if count <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(count)]


def plot_metrics(groups: Sequence[RunGroup], metrics: Sequence[str], path: Path,
                 title: str = "") -> Path | None:  # fmt: skip
    """``path`` with one panel per metric; ``None`` when there is nothing to draw."""
    if not groups or not metrics:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = max(5.0, 0.55 * len(groups) + 1.5)
    fig, axes = plt.subplots(1, len(metrics), figsize=(width * len(metrics), 4.2), squeeze=False)
    colours = _colours(len(groups))
    names = [group_name(g) for g in groups]
    for ax, metric in zip(axes[0], metrics, strict=True):
        scale = 100.0 if is_score(metric) else 1.0
        for x, (group, colour) in enumerate(zip(groups, colours, strict=True)):
            values = scale * group.values(metric)
            if len(values) == 0:
                continue
            std = values.std(ddof=1) if len(values) > 1 else 0.0
            ax.errorbar([x], [values.mean()], yerr=[std], fmt="o", color=colour, capsize=4, ms=6)
            ax.plot(np.full(len(values), x + 0.18), values, ".", color=colour, alpha=0.5, ms=4)
        ax.set_xticks(range(len(groups)), names, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel(header(metric))
        ax.grid(axis="y", alpha=0.3)
    caption = f"{title}\n" if title else ""
    caption += "mean ± std over runs; dots: single runs"
    fig.suptitle(_wrap(caption, fig), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_curves(groups: Sequence[RunGroup], metrics: Sequence[str], path: Path,
                title: str = "") -> Path | None:  # fmt: skip
    """``path`` with one panel per epoch metric; ``None`` when no run has an epoch of any."""
    drawn = [m for m in metrics if any(len(r.epochs.get(m, ())) for g in groups for r in g.runs)]
    if not groups or not drawn:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(drawn), figsize=(5.5 * len(drawn), 4.0), squeeze=False)
    colours = _colours(len(groups))
    for ax, metric in zip(axes[0], drawn, strict=True):
        scale = 100.0 if is_score(metric) else 1.0
        for group, colour in zip(groups, colours, strict=True):
            series = [r.epochs[metric] for r in group.runs if len(r.epochs.get(metric, ()))]
            if not series:
                continue
            length = min(len(s) for s in series)  # epochs every run of the group has
            values = scale * np.stack([s[:length] for s in series])  # (runs, epochs)
            epochs = group.runs[0].epochs["epoch"][:length]
            mean = values.mean(axis=0)
            ax.plot(epochs, mean, marker="o", ms=3, color=colour, label=group_name(group))
            if len(series) > 1:
                std = values.std(axis=0, ddof=1)
                ax.fill_between(epochs, mean - std, mean + std, color=colour, alpha=0.15)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("epoch")
        ax.set_ylabel(header(metric))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6, loc="best")
    return _save(fig, path, title, "mean over runs, band ± std")


def trend_values(groups: Sequence[RunGroup], x: str) -> dict[str, float]:
    """The numeric value of column ``x`` per group label string; ConfigError names a value
    that is not a number."""
    from symattn_cli.errors import ConfigError

    values = {}
    for group in groups:
        text = group.label[x]
        try:
            values[text] = float(text)
        except ValueError:
            raise ConfigError(
                f"x={x} needs numbers, but a group has {x}={text!r}; choose a numeric column "
                f"of {list(group.label)}"
            ) from None
    return values


def plot_trend(groups: Sequence[RunGroup], metrics: Sequence[str], x: str, path: Path,
               title: str = "") -> Path | None:  # fmt: skip
    """``path`` with one panel per metric against column ``x``: a line per label of the other
    columns, at the mean with ± std error bars; ``None`` when there is nothing to draw. The x
    axis places the distinct values in order, evenly spaced (a count of 0 under a ``num_*`` key
    is the full split: "0 (all)", placed last)."""
    if not groups or not metrics:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numbers = trend_values(groups, x)
    full = x.rsplit(".", 1)[-1].startswith("num_")  # 0 counts the whole split: the largest
    order = sorted(set(numbers.values()), key=lambda v: math.inf if full and v == 0 else v)
    lines: dict[str, list[RunGroup]] = {}
    for group in groups:
        rest = ", ".join(v for k, v in group.label.items() if k != x) or "all runs"
        lines.setdefault(rest, []).append(group)
    ticks = [f"{v:g}" + (" (all)" if full and v == 0 else "") for v in order]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4.0), squeeze=False)
    colours = _colours(len(lines))
    for ax, metric in zip(axes[0], metrics, strict=True):
        scale = 100.0 if is_score(metric) else 1.0
        for (name, members), colour in zip(lines.items(), colours, strict=True):
            points = sorted((order.index(numbers[g.label[x]]), scale * g.values(metric))
                            for g in members if len(g.values(metric)))  # fmt: skip
            if not points:
                continue
            where = [p for p, _ in points]
            mean = [v.mean() for _, v in points]
            std = [v.std(ddof=1) if len(v) > 1 else 0.0 for _, v in points]
            ax.errorbar(where, mean, yerr=std, marker="o", ms=4, capsize=3, color=colour,
                        label=name)  # fmt: skip
        ax.set_xticks(range(len(order)), ticks)
        ax.set_xlabel(x)
        ax.set_ylabel(header(metric))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6, loc="best")
    return _save(fig, path, title, "mean ± std over runs")


def scatter_points(groups: Sequence[RunGroup], pair: Sequence[str]) -> list[tuple]:
    """``(group name, mean x, std x, mean y, std y)`` of summary metrics ``pair = (x, y)``
    per group that has both, scores in percent; std 0 for a single run."""
    x, y = pair
    points = []
    for group in groups:
        xs, ys = _scaled(group, x), _scaled(group, y)
        if len(xs) and len(ys):
            points.append((group_name(group), xs.mean(), _std(xs), ys.mean(), _std(ys)))
    return points


def plot_scatter(groups: Sequence[RunGroup], pair: Sequence[str], path: Path,
                 title: str = "") -> Path | None:  # fmt: skip
    """``path`` with summary metric ``pair[1]`` against ``pair[0]``: a point per group at the
    means, ± std error bars along both axes, labelled with the group; ``None`` when no group
    has both metrics."""
    points = scatter_points(groups, pair)
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x, y = pair
    fig, ax = plt.subplots(figsize=(6.0, 4.5))
    for (name, x_mean, x_std, y_mean, y_std), colour in zip(points, _colours(len(points)),
                                                            strict=True):  # fmt: skip
        ax.errorbar([x_mean], [y_mean], xerr=[x_std], yerr=[y_std], fmt="o", ms=6, capsize=3,
                    color=colour, label=name)  # fmt: skip
        ax.annotate(name, (x_mean, y_mean), xytext=(5, 5), textcoords="offset points",
                    fontsize=7, color=colour)  # fmt: skip
    ax.set_xlabel(header(x))
    ax.set_ylabel(header(y))
    ax.set_title(f"{y} against {x}", fontsize=9)
    ax.margins(x=0.15, y=0.1)  # room for the labels beside the outermost points
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="best")
    return _save(fig, path, title, "mean ± std over runs, along both axes")


def _scaled(group: RunGroup, metric: str) -> np.ndarray:
    """The group's values of ``metric``, scores in percent."""
    return (100.0 if is_score(metric) else 1.0) * group.values(metric)


def _std(values: np.ndarray) -> float:
    """The sample standard deviation; 0 (no bar) for a single run."""
    return float(values.std(ddof=1)) if len(values) > 1 else 0.0


def _save(fig, path: Path, title: str, note: str) -> Path:
    """Caption ``fig`` with the title and what its marks mean, write it to ``path``, close it."""
    import matplotlib.pyplot as plt

    caption = f"{title}\n" if title else ""
    fig.suptitle(_wrap(caption + note, fig), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _wrap(text: str, fig) -> str:
    """``text`` broken into lines that fit the figure's width at the caption's font size."""
    characters = int(fig.get_figwidth() * 13)
    return "\n".join(textwrap.fill(line, characters) for line in text.splitlines())
