"""Learning curves of a run: ``curves.png`` next to its ``run.h5``.

Three panels against epochs: losses (the logged optimiser steps thin, the epoch means of
training and validation with markers), the scores (accuracy, and exact answers for token
tasks) with the test score marked after the last epoch, and the learning rate. Drawn with the
Agg backend from the run file alone, so it works for finished, diverged and killed runs, and
while a run is still writing its file; ``symattn train`` redraws it after every epoch.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

CURVES_FILE = "curves.png"
_MARGINS = ("left", "right", "bottom", "top", "wspace", "hspace")
SCORES = ("acc", "exact")
SPLIT_STYLE = {"train": ("tab:blue", "o"), "val": ("tab:orange", "s"), "test": ("tab:red", "*")}


def step_epochs(steps: np.ndarray, epochs: Mapping[str, np.ndarray]) -> np.ndarray:
    """Fractional epochs of optimiser steps, from the steps at which the epochs ended."""
    ends = np.concatenate([[0.0], epochs["step"]])
    marks = np.concatenate([[0.0], epochs["epoch"]])
    if len(ends) < 2 or ends[-1] <= 0:
        return np.asarray(steps, dtype=float)
    return np.interp(steps, ends, marks, right=math.nan)


def plot_learning_curves(
    epochs: Mapping[str, np.ndarray],
    steps: Mapping[str, np.ndarray],
    summary: Mapping[str, float],
    path: str | Path,
    title: str = "",
    layout: dict[str, float] | None = None,
) -> Path | None:
    """Write the learning curves to ``path``; ``None`` (nothing written) before any epoch.

    ``layout``: the panels' margins and spacing (``Figure.subplots_adjust``'s arguments).
    Empty, they are fitted to the drawn text (``tight_layout``) and stored in it; a later call
    with the same dict places the panels so without measuring the text again."""
    if len(epochs.get("epoch", ())) == 0:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_score, ax_lr) = plt.subplots(1, 3, figsize=(13, 3.6))
    x = epochs["epoch"]
    last = float(x[-1])
    if len(steps.get("step", ())):
        at = step_epochs(steps["step"], epochs)
        ax_loss.plot(at, steps["loss"], color="0.75", lw=0.8, label="train (logged steps)")
        ax_lr.plot(at, steps["lr"], color="0.4", lw=1.0)
    else:
        ax_lr.plot(x, epochs["lr"], color="0.4", marker=".")
    for split in ("train", "val"):
        colour, marker = SPLIT_STYLE[split]
        ax_loss.plot(x, epochs[f"{split}_loss"], color=colour, marker=marker, ms=3, label=split)
        for score in SCORES:
            if f"{split}_{score}" in epochs:
                style = "-" if score == "acc" else "--"
                ax_score.plot(x, epochs[f"{split}_{score}"], style, color=colour, marker=marker,
                              ms=3, label=f"{split} {score}")  # fmt: skip
    colour, marker = SPLIT_STYLE["test"]
    for score in SCORES:
        value = summary.get(f"test_{score}", math.nan)
        if math.isfinite(value):
            ax_score.plot([last], [value], marker, color=colour, ms=10,
                          label=f"test {score} {value:.4f}")  # fmt: skip
    value = summary.get("test_loss", math.nan)
    if math.isfinite(value):
        ax_loss.plot([last], [value], marker, color=colour, ms=10, label=f"test {value:.4f}")
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("loss")
    ax_score.set_ylabel("score")
    ax_score.set_ylim(-0.02, 1.02)
    ax_lr.set_ylabel("learning rate")
    for ax in (ax_loss, ax_score, ax_lr):
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    ax_loss.legend(fontsize=7)
    ax_score.legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title, fontsize=9)
    if layout:
        fig.subplots_adjust(**layout)
    else:
        fig.tight_layout()
        if layout is not None:
            params = fig.subplotpars
            layout.update({key: getattr(params, key) for key in _MARGINS})
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial.png")
    fig.savefig(partial, dpi=110)
    plt.close(fig)
    os.replace(partial, path)  # a viewer never sees a half-written file
    return path


def epoch_plotter(run_file, path: Path, title: str = "") -> Callable[[], None]:
    """A callback for the trainer's ``on_epoch``: redraw ``path`` from the open run file
    after every epoch, so that a long run's curves can be looked at while it trains. The
    panels keep the layout fitted at the first redraw, so that later redraws do not measure
    every label again. A plotting failure warns once and stops the redrawing; the run goes
    on."""
    failed = False
    layout: dict[str, float] = {}

    def draw() -> None:
        nonlocal failed
        if failed:
            return
        try:
            epochs, steps = run_file.metrics("epoch"), run_file.metrics("step")
            plot_learning_curves(epochs, steps, {}, path, title=title, layout=layout)
        except Exception as err:  # noqa: BLE001 - a plot must not stop training
            failed = True
            print(f"symattn: learning curves not drawn ({err}); training goes on",
                  file=sys.stderr)  # fmt: skip

    return draw


def plot_run(run_file: Path, title: str = "") -> Path | None:
    """The learning curves of ``run_file``, written as ``curves.png`` in its directory."""
    from symattn_cli.train.runfile import read_metrics, read_summary

    run_file = Path(run_file)
    return plot_learning_curves(
        read_metrics(run_file, "epoch"),
        read_metrics(run_file, "step"),
        read_summary(run_file),
        run_file.parent / CURVES_FILE,
        title=title,
    )
