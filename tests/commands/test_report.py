"""``symattn report`` end to end: a real sweep, unfinished runs, errors, positional paths."""

from __future__ import annotations

import csv

import numpy as np
import pytest
from omegaconf import OmegaConf

from symattn_cli.commands.report import collect, paths_override, positional_paths
from symattn_cli.configs.base import ReportConfig
from symattn_cli.errors import ConfigError
from symattn_cli.train.runfile import read_choices_yaml, read_summary, read_table
from tests.helpers import TINY_TRAIN, run_symattn
from tests.report.runfiles import write_run

OUTPUTS = ("report.csv", "report.md", "report.h5", "metrics.png", "curves.png")


@pytest.mark.slow
def test_report_of_a_sweep_of_two_models_and_two_seeds(workdir):
    sweep = workdir / "sweep"
    args = [a for a in TINY_TRAIN if not a.startswith("model")]
    trained = run_symattn(
        "train", "-m", *args, "model=cnn_mini,gcnn_mini", "seed=0,1",
        "trainer.epochs=2", "trainer.max_steps_per_epoch=3", f"hydra.sweep.dir={sweep}",
        cwd=workdir,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    runs = sorted(sweep.glob("*/run.h5"))
    assert len(runs) == 4
    assert "model: cnn_mini" in read_choices_yaml(runs[0])  # the option, as on the command line

    out = workdir / "report"
    result = run_symattn("report", "sweep", f"hydra.run.dir={out}", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "4 finished runs in 2 groups" in result.stdout
    lines = [line for line in result.stdout.splitlines() if "_mini" in line]
    assert len(lines) == 2 and "cnn_mini" in lines[0] and "gcnn_mini" in lines[1]
    assert all("│ 2 │" in line and "±" in line for line in lines)  # n = 2, mean ± std

    accs = {}
    for path in runs:
        model = "gcnn_mini" if int(path.parent.name) >= 2 else "cnn_mini"  # sweep order
        accs.setdefault(model, []).append(read_summary(path)["test_acc"])
    with open(out / "report.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["model"] for row in rows] == ["cnn_mini", "gcnn_mini"]
    for row in rows:
        assert row["n"] == "2"
        assert float(row["test_acc_mean"]) == pytest.approx(np.mean(accs[row["model"]]))
        assert float(row["test_acc_std"]) == pytest.approx(np.std(accs[row["model"]], ddof=1))
        assert float(row["best_epoch_mean"]) in (1.0, 1.5, 2.0)
        assert float(row["train_time_s_mean"]) > 0 and float(row["parameters"]) > 0

    groups = read_table(out / "report.h5", "groups")
    assert list(groups["model"]) == ["cnn_mini", "gcnn_mini"] and list(groups["n"]) == [2, 2]
    assert np.allclose(groups["test_acc_mean"], [float(r["test_acc_mean"]) for r in rows])
    per_run = read_table(out / "report.h5", "runs")
    assert list(per_run["status"]) == ["finished"] * 4 and list(per_run["seed"]) == list("0101")
    assert read_summary(out / "report.h5")["groups"] == 2

    markdown = (out / "report.md").read_text()
    assert "| model | n | test_acc (%) | best epoch | train s | params |" in markdown
    assert markdown.count("| 2 |") == 2
    for name in ("metrics.png", "curves.png"):
        assert (out / name).stat().st_size > 10_000


def test_unfinished_and_failed_runs_are_listed_not_averaged(symattn, workdir):
    sweep = workdir / "sweep"
    write_run(sweep / "0", seed=0, test_acc=0.6)
    write_run(sweep / "1", seed=1, test_acc=0.8)
    write_run(sweep / "2", seed=2, status="failed", epochs=1)
    write_run(sweep / "3", seed=3, status="stopped", epochs=1)
    live = write_run(sweep / "4", seed=4, epochs=1, planned=3, keep_open=True)
    try:
        result = symattn("report", "sweep", "hydra.run.dir=rep", cwd=workdir)
    finally:
        live.close()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "2 finished runs in 1 group" in out and "3 not averaged" in out
    assert "70.00 ± 14.14" in out  # the two finished runs only
    for status, note in (("failed", ""), ("stopped", "resume="), ("running", "still training")):
        line = next(x for x in out.splitlines() if f"│ {status}" in x)
        assert note in line
    assert "1/3" in out  # the live run's epochs so far
    per_run = read_table(workdir / "rep" / "report.h5", "runs")
    assert list(per_run["status"]) == ["finished", "finished", "failed", "stopped", "running"]
    assert "not averaged" in (workdir / "rep" / "report.md").read_text()


def test_bad_path_and_empty_directory_are_one_line_errors(symattn, workdir):
    result = symattn("report", "nowhere", cwd=workdir)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "'nowhere' does not exist" in result.stderr
    (workdir / "empty").mkdir()
    result = symattn("report", "empty", cwd=workdir)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "'empty' holds no run file" in result.stderr
    result = symattn("report", cwd=workdir)
    assert result.returncode == 2 and "no runs to report on" in result.stderr
    assert not [p for p in workdir.rglob("report.*") if p.suffix != ".log"]  # nothing written


def test_a_report_never_overwrites_files(symattn, workdir):
    write_run(workdir / "run", test_acc=0.5)
    first = symattn("report", "paths=[run]", "plot=false", "hydra.run.dir=rep", cwd=workdir)
    assert first.returncode == 0, first.stderr
    before = (workdir / "rep" / "report.md").read_text()
    assert not (workdir / "rep" / ".hydra").exists()  # the config is in report.h5
    second = symattn("report", "run", "hydra.run.dir=rep", cwd=workdir)
    assert second.returncode == 2 and "already exists" in second.stderr
    assert "hydra.run.dir" in second.stderr
    assert (workdir / "rep" / "report.md").read_text() == before


def test_positional_paths_become_the_paths_override(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model=a,seed=0").mkdir()  # a job directory named by Hydra's override_dirname
    args = ["runs/a", "model=a,seed=0", "metrics=[test_acc]", "-m", "--cfg", "job", "~/x",
            "+extra=1", "--info", "config", "-sc", "query=bash"]  # fmt: skip
    paths, rest = positional_paths(args)
    assert paths == ["runs/a", "model=a,seed=0", "~/x"]
    assert rest == ["metrics=[test_acc]", "-m", "--cfg", "job", "+extra=1", "--info", "config",
                    "-sc", "query=bash"]  # fmt: skip
    assert paths_override(["a b", "it's"]) == "paths=['a b','it\\'s']"


def test_quoted_paths_reach_the_config(symattn, workdir):
    write_run(workdir / "a b,c" / "0", test_acc=0.5)
    result = symattn("report", "a b,c", "--cfg", "job", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "- a b,c" in result.stdout


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("metrics", ["tst_acc"], "metrics: 'tst_acc' is not a summary metric"),
        ("sort_by", "tst_acc", "sort_by: 'tst_acc' is not a summary metric"),
        ("curves", ["val_nope"], "curves: 'val_nope' is not an epoch metric"),
        ("group_by", ["modle"], "group_by: 'modle' is neither a config group"),
        ("scatter", ["train_time_s", "tst_acc"], "scatter: 'tst_acc' is not a summary metric"),
        ("scatter", ["test_acc"], r"^scatter=\[test_acc\] needs two summary metrics, the x "
         r"axis then the y axis, e.g. scatter=\[train_time_s,test_acc\]$"),
        ("scatter", ["a", "b", "c"], r"^scatter=\[a,b,c\] needs two summary metrics"),
    ],
)  # fmt: skip
def test_bad_options_name_the_value_and_the_choices(tmp_path, monkeypatch, key, value, message):
    write_run(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.merge(OmegaConf.structured(ReportConfig(paths=["run"])), {key: value})
    with pytest.raises(ConfigError, match=message):
        collect(cfg)


def test_a_trend_plots_each_metric_against_a_numeric_column(tmp_path, monkeypatch):
    """``x=data.num_train``: a line per model over the training-set sizes; a column that is
    not a number is refused with its value."""
    from symattn_cli.report import plots

    for model in ("cnn_mini", "gcnn_mini"):
        for size in (0, 350, 1050):
            for seed in (0, 1):
                write_run(tmp_path / f"{model}-{size}-{seed}", model=model, seed=seed,
                          num_train=size, test_acc=0.5 + size / 5000 + seed / 100)  # fmt: skip
    monkeypatch.chdir(tmp_path)
    found = collect(OmegaConf.structured(ReportConfig(paths=["."])))
    assert found.columns == ["model", "data.num_train"] and len(found.groups) == 6
    assert plots.trend_values(found.groups, "data.num_train") == {"0": 0, "350": 350,
                                                                  "1050": 1050}  # fmt: skip
    path = plots.plot_trend(found.groups, ["test_acc"], "data.num_train", tmp_path / "t.png")
    assert path.stat().st_size > 10_000
    with pytest.raises(ConfigError, match="x=model needs numbers.*'cnn_mini'"):
        plots.trend_values(found.groups, "model")


def test_a_trend_over_a_column_the_report_lacks_says_how_to_add_it(symattn, workdir):
    for seed in (0, 1):
        write_run(workdir / "runs" / f"s{seed}", seed=seed)
    result = symattn("report", "runs", "x=seed", cwd=workdir)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "x=seed is not a column of this report; this report groups by no option; add it " \
           "with group_by=[seed]" in result.stderr  # fmt: skip


def _cost_runs(directory):
    """Two seeds each of two models, with accuracies and training times that differ."""
    for model, time in (("cnn_mini", 20.0), ("gcnn_mini", 60.0)):
        for seed in (0, 1):
            write_run(directory / f"{model}-{seed}", model=model, seed=seed,
                      test_acc=(0.6 if model == "cnn_mini" else 0.8) + seed / 10,
                      train_time_s=time + 4 * seed)  # fmt: skip


def test_a_scatter_draws_one_metric_against_another(tmp_path, monkeypatch):
    """``scatter=[train_time_s,test_acc]``: a point per group at the means of both metrics,
    with the std over its runs along each axis, drawn into scatter.png beside the tables."""
    from symattn_cli.commands import report as command
    from symattn_cli.report import plots

    _cost_runs(tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.structured(ReportConfig(paths=["runs"], scatter=["train_time_s", "test_acc"]))
    found = collect(cfg)
    points = plots.scatter_points(found.groups, ["train_time_s", "test_acc"])
    spread = np.std([0.0, 4.0], ddof=1)
    assert [p[0] for p in points] == ["cnn_mini", "gcnn_mini"]
    assert np.allclose([p[1:] for p in points], [[22.0, spread, 65.0, np.sqrt(50.0)],
                                                 [62.0, spread, 85.0, np.sqrt(50.0)]])  # fmt: skip

    out = tmp_path / "rep"
    out.mkdir()
    monkeypatch.setattr(command, "run_dir", lambda: out)
    command.report(cfg)
    assert (out / "scatter.png").stat().st_size > 10_000
    assert not (out / "trend.png").exists()


def test_a_bad_scatter_is_a_one_line_error_before_any_file(symattn, workdir):
    _cost_runs(workdir / "runs")
    for option, message in [
        ("scatter=[train_time_s]", "scatter=[train_time_s] needs two summary metrics"),
        ("scatter=[train_time,test_acc]", "scatter: 'train_time' is not a summary metric"),
    ]:
        result = symattn("report", "runs", option, "hydra.run.dir=rep", cwd=workdir)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert message in result.stderr
    assert not [p for p in (workdir / "rep").iterdir() if p.suffix != ".log"]  # nothing written
