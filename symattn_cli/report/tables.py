"""The report's tables: one row per group (mean ± std over its runs) and the runs left out,
as rich tables for the terminal, Markdown for documents and CSV of the raw numbers.

Scores (``*_acc``, ``*_exact``) are shown in percent; the CSV keeps fractions.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from symattn_cli.bench.report import number
from symattn_cli.report.groups import SCORES, RunGroup, value
from symattn_cli.report.runs import Run


def is_score(metric: str) -> bool:
    return metric.endswith(SCORES)


def header(metric: str) -> str:
    return f"{metric} (%)" if is_score(metric) else metric


def mean_std(values: np.ndarray, spec: str) -> str:
    """``"92.15 ± 0.31"``; the mean alone for one value; ``-`` for none."""
    if len(values) == 0:
        return "-"
    if len(values) == 1:
        return number(float(values[0]), spec)
    return f"{number(float(values.mean()), spec)} ± {number(float(values.std(ddof=1)), spec)}"


def metric_cell(group: RunGroup, metric: str) -> str:
    values = group.values(metric)
    return mean_std(100 * values if is_score(metric) else values, ".2f" if is_score(metric)
                    else ".4g")  # fmt: skip


def epoch_cell(group: RunGroup) -> str:
    epochs = group.values("best_epoch")
    if len(epochs) == 0:
        return "-"
    low, high = int(epochs.min()), int(epochs.max())
    return f"{low}" if low == high else f"{low}–{high}"


def groups_table(groups: Sequence[RunGroup], columns: Sequence[str], metrics: Sequence[str],
                 title: str = ""):  # fmt: skip
    """One row per group: its label, n, every metric as mean ± std, the best-on-validation
    epoch (range over the runs), training time and parameters."""
    from rich.table import Table

    table = Table(title=title or None)
    for column in columns:
        table.add_column(column, no_wrap=True)
    table.add_column("n", justify="right")
    for metric in metrics:
        table.add_column(header(metric), justify="right", no_wrap=True)
    for name in ("best epoch", "train s", "params"):
        table.add_column(name, justify="right", no_wrap=True)
    for group in groups:
        parameters = group.values("parameters")
        table.add_row(
            *(group.label[c] for c in columns),
            str(len(group.runs)),
            *(metric_cell(group, m) for m in metrics),
            epoch_cell(group),
            mean_std(group.values("train_time_s"), ".0f"),
            number(float(parameters.mean()) if len(parameters) else math.nan, ",.0f"),
        )
    return table


def run_name(path: Path, cwd: Path | None = None) -> str:
    """The run's directory, relative to ``cwd`` when it lies below it."""
    directory = Path(path).parent
    try:
        relative = os.path.relpath(directory, cwd or Path.cwd())
    except ValueError:  # another drive
        return str(directory)
    return str(directory) if relative.startswith("..") else relative


def excluded_table(runs: Sequence[Run], columns: Sequence[str], score: str):
    """The runs that are not averaged: status, label, seed, epochs written, last score."""
    from rich.table import Table

    table = Table(title="not averaged (failed, diverged, unfinished, damaged or unreadable)")
    for name in ("run", "status", *columns, "seed", "epochs", f"last {header(score)}", "note"):
        table.add_column(name, justify="right" if name in ("seed", "epochs") or
                         name.startswith("last") else "left")  # fmt: skip
    for run in runs:
        last = run.epochs.get(score, ())
        shown = float(last[-1]) * (100 if is_score(score) else 1) if len(last) else math.nan
        planned = run.config.get("trainer.epochs")
        epochs = f"{run.epochs_done}/{planned}" if planned else str(run.epochs_done)
        table.add_row(
            run_name(run.path),
            run.status,
            *(value(run, c) for c in columns),
            value(run, "seed"),
            epochs if run.status not in ("unreadable", "damaged") else "-",
            number(shown, ".2f"),
            note(run),
        )
    return table


def note(run: Run) -> str:
    if run.status in ("unreadable", "damaged"):
        return run.error
    if run.status == "stopped":
        return (f"its writer is gone; `symattn train resume={run_name(run.path)}` "
                "continues it")  # fmt: skip
    if run.status == "running":
        return "still training"
    return ""


def markdown(table) -> str:
    """A rich table as a Markdown table (markup removed; numbers right-aligned)."""
    from rich.text import Text

    def plain(cell: Any) -> str:
        text = cell.plain if isinstance(cell, Text) else Text.from_markup(str(cell)).plain
        return text.replace("|", "\\|")

    heads = [plain(c.header) for c in table.columns]
    rules = ["---:" if c.justify == "right" else "---" for c in table.columns]
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join(rules) + "|"]
    cells = [[plain(cell) for cell in column.cells] for column in table.columns]
    for row in zip(*cells, strict=True):
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_csv(path: Path, records: Sequence[Mapping[str, Any]],
              fields: Sequence[str] = ()) -> Path:  # fmt: skip
    """The records as CSV, one column per key (``fields``, then any other in first-seen
    order); NaN as an empty cell. Never overwrites a file."""
    names = list(dict.fromkeys([*fields, *(key for record in records for key in record)]))
    with open(path, "x", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=names)
        writer.writeheader()
        for record in records:
            writer.writerow({k: _csv_cell(record.get(k)) for k in names})
    return Path(path)


def _csv_cell(value: Any) -> Any:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return value
