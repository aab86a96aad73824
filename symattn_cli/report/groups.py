"""Bucket runs by the config values that differ between them (a :class:`RunGroup` each), and
aggregate each bucket.

A column is a config group (``model``: its option, ``r4_mini``) or a dotted config key
(``data.variant``). By default the columns are what differs between the runs: a config group
whose option differs stands for every key under it that the option fixes (``model`` instead
of ``model.group``, ``model.family``, ...); keys that differ otherwise are columns of their
own. The keys in ``ignore`` (``seed`` first of all, so that seeds collapse into one row) are
never columns. Only finished runs are averaged; the others are listed (:func:`excluded`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from symattn_cli.errors import ConfigError
from symattn_cli.report.runs import Run, format_value

MISSING = "—"
SCORES = ("acc", "exact")


@dataclasses.dataclass
class RunGroup:
    """The runs that share one label (a value per column); ``runs`` are the finished ones.
    (A bucket of runs; a symmetry group is :class:`symattn_cli.groups.Group`.)"""

    label: dict[str, str]
    runs: list[Run]

    def values(self, metric: str) -> np.ndarray:
        """The finite values of a summary metric over the group's runs."""
        values = np.array([run.summary.get(metric, math.nan) for run in self.runs], dtype=float)
        return values[np.isfinite(values)]

    def record(self, metrics: Sequence[str]) -> dict[str, Any]:
        """The group as one row of raw numbers: mean, sample std and n of every metric."""
        row: dict[str, Any] = dict(self.label)
        row["n"] = len(self.runs)
        for metric in (*metrics, "best_epoch", "train_time_s"):
            values = self.values(metric)
            row[f"{metric}_mean"] = float(values.mean()) if len(values) else math.nan
            row[f"{metric}_std"] = float(values.std(ddof=1)) if len(values) > 1 else math.nan
            if metric == "best_epoch":
                row["best_epoch_min"] = float(values.min()) if len(values) else math.nan
                row["best_epoch_max"] = float(values.max()) if len(values) else math.nan
        parameters = self.values("parameters")
        row["parameters"] = float(parameters.mean()) if len(parameters) else math.nan
        return row


def value(run: Run, column: str) -> str:
    """A run's cell in ``column``: its option of a config group, else its config value."""
    if column in run.choices:
        return run.choices[column]
    if column in run.config:
        return format_value(run.config[column])
    return MISSING


def _ignored(key: str, ignore: Sequence[str]) -> bool:
    return any(key == name or key.startswith(f"{name}.") for name in ignore)


def _config_groups(runs: Sequence[Run]) -> list[str]:
    return list(dict.fromkeys(group for run in runs for group in run.choices))


def _config_keys(runs: Sequence[Run]) -> list[str]:
    return list(dict.fromkeys(key for run in runs for key in run.config))


def differing_columns(runs: Sequence[Run], ignore: Sequence[str] = ("seed",)) -> list[str]:
    """The columns that tell the runs apart, in config order (see the module docstring)."""
    runs = [run for run in runs if run.config]
    keys = _config_keys(runs)
    differ = [k for k in keys if not _ignored(k, ignore) and len({value(r, k) for r in runs}) > 1]
    columns: list[str] = []
    for group in _config_groups(runs):
        if _ignored(group, ignore) or len({value(r, group) for r in runs}) < 2:
            continue
        columns.append(group)
        # keys under the group that its option fixes are said by the option's name
        fixed = [
            k
            for k in differ
            if k.startswith(f"{group}.")
            and all(
                len({value(r, k) for r in runs if value(r, group) == option}) == 1
                for option in {value(r, group) for r in runs}
            )
        ]
        differ = [k for k in differ if k not in fixed]
    order = {key: index for index, key in enumerate(keys)}

    def position(column: str) -> float:
        if column in order:
            return order[column]
        under = [order[k] for k in keys if k.startswith(f"{column}.")]
        return min(under) - 0.5 if under else math.inf

    return sorted(columns + differ, key=position)


def check_columns(runs: Sequence[Run], columns: Sequence[str]) -> None:
    """Raise :class:`ConfigError` for a ``group_by`` entry no run knows."""
    known_groups = _config_groups(runs)
    known_keys = _config_keys(runs)
    for column in columns:
        if column not in known_groups and column not in known_keys:
            raise ConfigError(
                f"group_by: {column!r} is neither a config group ({', '.join(known_groups)}) "
                f"nor a config key of these runs (e.g. {', '.join(known_keys[:4])}); use one of "
                "those, or group_by=[] for the values that differ"
            )


def summary_metrics(runs: Sequence[Run]) -> list[str]:
    return sorted({name for run in runs for name in run.summary})


def default_metrics(runs: Sequence[Run]) -> list[str]:
    """The test scores the runs have: ``test_acc``, and ``test_exact``, ``test_long_*`` for
    sequence tasks."""
    return [m for m in summary_metrics(runs) if m.startswith("test") and m.endswith(SCORES)]


def check_metrics(runs: Sequence[Run], metrics: Sequence[str], option: str = "metrics") -> None:
    """Raise :class:`ConfigError` for a metric (of the option ``option``) no run has."""
    known = summary_metrics(runs)
    for metric in metrics:
        if metric not in known:
            raise ConfigError(
                f"{option}: {metric!r} is not a summary metric of these runs; choose from "
                f"{', '.join(known)}"
            )


def group_runs(runs: Sequence[Run], columns: Sequence[str]) -> list[RunGroup]:
    """The finished runs grouped by their label, groups in order of first appearance."""
    groups: dict[tuple[str, ...], RunGroup] = {}
    for run in runs:
        if not run.finished:
            continue
        key = tuple(value(run, c) for c in columns)
        if key not in groups:
            groups[key] = RunGroup(label=dict(zip(columns, key, strict=True)), runs=[])
        groups[key].runs.append(run)
    return list(groups.values())


def sort_groups(groups: list[RunGroup], metric: str) -> list[RunGroup]:
    """Best first by the mean of ``metric`` (lowest first for a loss); NaN last."""
    sign = 1.0 if "loss" in metric else -1.0

    def key(group: RunGroup) -> float:
        values = group.values(metric)
        return sign * float(values.mean()) if len(values) else math.inf

    return sorted(groups, key=key)


def excluded(runs: Sequence[Run]) -> list[Run]:
    """Runs that are not averaged: failed, diverged, unfinished (running or stopped) and
    unreadable ones."""
    return [run for run in runs if not run.finished]
