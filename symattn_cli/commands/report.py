"""``symattn report PATH...``: compare training runs, as a table per group of runs and plots.

Reads the run files behind the paths (run directories, ``run.h5`` files, sweep directories,
globs; runs still training too, through SWMR), groups the runs by the config values that
differ between them (:mod:`symattn_cli.report.groups`: seeds collapse into one row) and
prints, per group, every test score as mean ± std with n, the best-on-validation epoch, the
training time and the parameters. Failed, diverged and unfinished runs are listed, not
averaged; so are damaged run files (cut short, or failing a checksum), with what is wrong.
Writes ``report.csv`` (raw numbers), ``report.md``, ``report.h5`` (tables
``/results/groups`` and ``/results/runs``), ``metrics.png`` and ``curves.png`` (with ``x=``,
``trend.png``; with ``scatter=``, ``scatter.png``) into its run directory, and never over an
existing file.

Paths are positional on the command line; :func:`positional_paths` turns them into the
``paths=[...]`` override, so every Hydra option still works.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from symattn_cli.commands.common import environment, fail, hydra_entry, run_dir, to_yaml
from symattn_cli.errors import ConfigError, UserError

CSV_FILE, MARKDOWN_FILE, RESULTS_FILE = "report.csv", "report.md", "report.h5"
# Hydra flags followed by a value that is not a path
VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name",
               "-cn", "--config-dir", "-cd", "--experimental-rerun"}  # fmt: skip
INFO_TOPICS = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def positional_paths(args: list[str]) -> tuple[list[str], list[str]]:
    """``(paths, other args)``: an argument is a path if it exists, starts with ``~/``, or is
    neither a flag nor an override (no ``=``, no leading ``+``/``~``); flag values stay."""
    paths, rest = [], []
    iterator = iter(enumerate(args))
    for index, arg in iterator:
        after_flag = index > 0 and (
            args[index - 1] in VALUE_FLAGS
            or (args[index - 1] in ("--info", "-i") and arg in INFO_TOPICS)
        )
        if after_flag or arg.startswith("-"):
            rest.append(arg)
        elif os.path.exists(os.path.expanduser(arg)) or arg.startswith("~/"):
            paths.append(arg)
        elif "=" in arg or arg.startswith(("+", "~")):
            rest.append(arg)
        else:
            paths.append(arg)
    return paths, rest


def paths_override(paths: list[str]) -> str:
    """``paths=['a','b c']``: each path a quoted string of Hydra's override grammar."""

    def quote(path: str) -> str:
        return "'" + path.replace("\\", "\\\\").replace("'", "\\'") + "'"

    return "paths=[" + ",".join(quote(p) for p in paths) + "]"


def _prepare_paths_argv() -> None:
    paths, rest = positional_paths(sys.argv[1:])
    if not paths:
        return
    if any(a.startswith("paths=") for a in rest):
        fail(
            f"paths given twice: positionally ({' '.join(paths)}) and as paths=[...]; give "
            "them one way"
        )
    sys.argv = [sys.argv[0], *rest, paths_override(paths)]


@dataclasses.dataclass
class Report:
    """What a report shows: the runs, the columns that label them, the metrics and curves,
    the groups of finished runs and the runs left out."""

    runs: list
    columns: list[str]
    metrics: list[str]
    curves: list[str]
    score: str
    groups: list
    left_out: list
    skipped: list
    title: str


def collect(cfg: Any) -> Report:
    """Find and read the runs of ``cfg.paths`` and group them; bad input raises
    :class:`UserError` naming the value and the fix."""
    from symattn_cli.report import groups as grouping
    from symattn_cli.report.runs import find_run_files, read_runs

    if not cfg.paths:
        raise ConfigError(
            "no runs to report on: give run directories, run.h5 files or sweep directories, "
            "e.g. `symattn report multirun/train/2026-11-22/10-00-00` (or paths=[...])"
        )
    files, skipped = find_run_files(list(cfg.paths), Path.cwd())
    runs = read_runs(files)
    readable = [run for run in runs if run.config]
    if cfg.group_by:
        grouping.check_columns(readable, list(cfg.group_by))
        columns = list(cfg.group_by)
    else:
        columns = grouping.differing_columns(readable, list(cfg.ignore))
    finished = [run for run in runs if run.finished]
    grouping.check_metrics(readable, list(cfg.metrics))
    grouping.check_metrics(readable, [cfg.sort_by] if cfg.sort_by else [], option="sort_by")
    if cfg.scatter and len(cfg.scatter) != 2:
        raise ConfigError(
            f"scatter=[{','.join(cfg.scatter)}] needs two summary metrics, the x axis then the "
            "y axis, e.g. scatter=[train_time_s,test_acc]"
        )
    grouping.check_metrics(readable, list(cfg.scatter), option="scatter")
    metrics = list(cfg.metrics) or grouping.default_metrics(finished or readable)
    score = _score(readable)
    known = sorted({name for run in readable for name in run.epochs})
    unknown = [name for name in cfg.curves if name not in known]
    if unknown:
        raise ConfigError(
            f"curves: {unknown[0]!r} is not an epoch metric of these runs; choose from "
            f"{', '.join(known)}"
        )
    groups = grouping.group_runs(runs, columns)
    if cfg.sort_by:
        groups = grouping.sort_groups(groups, cfg.sort_by)
    return Report(
        runs=runs,
        columns=columns,
        metrics=metrics,
        curves=list(cfg.curves) or [score, "train_loss"],
        score=score,
        groups=groups,
        left_out=grouping.excluded(runs),
        skipped=skipped,
        title=cfg.title or _title(finished, groups, runs),
    )


def report(cfg: Any) -> Report:
    """Build the report described by ``cfg``, write its files and print its tables."""
    from rich.console import Console

    from symattn_cli.report import plots, tables
    from symattn_cli.report.groups import RunGroup
    from symattn_cli.train.runfile import write_results_file

    found = collect(cfg)
    directory = run_dir()
    targets = [directory / name for name in (CSV_FILE, MARKDOWN_FILE, RESULTS_FILE)]
    if cfg.x and cfg.x not in found.columns:
        choices = (f"choose one of {found.columns} (or add it with group_by=[...])"
                   if found.columns else f"this report groups by no option; add it with "
                   f"group_by=[{cfg.x}]")  # fmt: skip
        raise ConfigError(f"x={cfg.x} is not a column of this report; {choices}")
    if cfg.x:
        plots.trend_values(found.groups, cfg.x)  # a non-numeric column fails before any file
    if cfg.plot:
        targets += [directory / plots.METRICS_FILE, directory / plots.CURVES_FILE]
        targets += [directory / plots.TREND_FILE] if cfg.x else []
        targets += [directory / plots.SCATTER_FILE] if cfg.scatter else []
    existing = [path for path in targets if path.exists()]
    if existing:
        raise UserError(
            f"{existing[0]} already exists and a report never overwrites a file; choose "
            "another hydra.run.dir"
        )

    columns, metrics, groups = found.columns, found.metrics, found.groups
    group_table = tables.groups_table(groups, columns, metrics)
    dropped = tables.excluded_table(found.left_out, columns, found.score)
    records = [group.record(metrics) for group in groups]
    fields = list(RunGroup(label=dict.fromkeys(columns, ""), runs=[]).record(metrics))
    tables.write_csv(directory / CSV_FILE, records, fields=fields)
    markdown = [f"**{found.title}**", "", tables.markdown(group_table)]
    if found.left_out:
        markdown += ["", f"**{dropped.title}**", "", tables.markdown(dropped)]
    (directory / MARKDOWN_FILE).write_text("\n".join(markdown) + "\n")
    run_rows = [_run_record(run, columns, metrics) for run in found.runs]
    path = write_results_file(
        directory / RESULTS_FILE,
        command="report",
        config_yaml=to_yaml(cfg),
        env=environment("cpu"),
        tables={"groups": records, "runs": run_rows} if records else {"runs": run_rows},
        summary={
            "runs": len(found.runs),
            "finished": sum(len(group.runs) for group in groups),
            "groups": len(groups),
            "excluded": len(found.left_out),
        },
    )
    figures = []
    if cfg.plot:
        figures = [
            plots.plot_metrics(groups, metrics, directory / plots.METRICS_FILE, found.title),
            plots.plot_curves(groups, found.curves, directory / plots.CURVES_FILE, found.title),
        ]
        if cfg.x:
            figures.append(plots.plot_trend(groups, metrics, cfg.x,
                                            directory / plots.TREND_FILE, found.title))  # fmt: skip
        if cfg.scatter:
            scatter = directory / plots.SCATTER_FILE
            figures.append(plots.plot_scatter(groups, list(cfg.scatter), scatter, found.title))

    console = Console(width=None if sys.stdout.isatty() else 250)  # files: no wrapping
    console.print(found.title, highlight=False)
    console.print(group_table)
    if found.left_out:
        console.print(dropped)
    if not groups:
        console.print(f"no finished run yet among the {len(found.runs)} found")
    if found.skipped:
        console.print(f"skipped {len(found.skipped)} run files of other commands (benchmark)")
    unchecked = [run for run in found.runs if run.note]
    if unchecked:
        console.print(
            f"note: {_count(len(unchecked), 'run file')} ({_names(unchecked)}) written before run "
            "files carried checksums: damage in them cannot be detected",
            highlight=False,
        )
    console.print(f"tables: {path}, {directory / CSV_FILE}, {directory / MARKDOWN_FILE}")
    for figure in figures:
        if figure is not None:
            console.print(f"plot: {figure}")
    return found


def _score(runs) -> str:
    """The validation score runs are selected on: exact answers for token tasks, else acc."""
    if any("val_exact" in run.epochs for run in runs):
        return "val_exact"
    return "val_acc"


def _title(finished, groups, runs) -> str:
    commits = sorted({run.commit[:7] + (" (dirty)" if run.dirty else "") for run in finished})
    shown = ", ".join(commits[:3]) + (" ..." if len(commits) > 3 else "")
    title = (
        f"{_count(len(finished), 'finished run')} in {_count(len(groups), 'group')} "
        "(mean ± std over runs)"
    )
    if len(runs) > len(finished):
        title += f", {len(runs) - len(finished)} not averaged"
    return title + (f"; commit {shown}" if shown else "")


def _names(runs) -> str:
    from symattn_cli.report.tables import run_name

    names = [run_name(run.path) for run in runs]
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _run_record(run, columns, metrics) -> dict[str, Any]:
    from symattn_cli.report.groups import value
    from symattn_cli.report.tables import run_name

    row: dict[str, Any] = {"run": run_name(run.path), "status": run.status}
    row.update({column: value(run, column) for column in columns})
    row["seed"] = value(run, "seed")
    row["epochs"] = run.epochs_done
    for name in (*metrics, "best_epoch", "train_time_s", "parameters"):
        row[name] = run.summary.get(name, float("nan"))
    row["git_commit"] = run.commit
    row["error"] = run.error
    return row


def _task(cfg: Any) -> None:
    report(cfg)


def main() -> None:
    _prepare_paths_argv()
    hydra_entry("report", _task)()
