"""Finding run files, labelling runs by what differs between them, and the group numbers."""

from __future__ import annotations

import math

import h5py
import numpy as np
import pytest

from symattn_cli.errors import ConfigError, UserError
from symattn_cli.report.groups import (
    check_columns,
    default_metrics,
    differing_columns,
    excluded,
    group_runs,
    sort_groups,
)
from symattn_cli.report.runs import find_run_files, read_run, read_runs
from symattn_cli.report.tables import groups_table, markdown
from tests.report.runfiles import write_run


def test_seeds_collapse_and_a_model_option_stands_for_its_keys(tmp_path):
    specs = [("cnn_mini", 0, 0.5), ("cnn_mini", 1, 0.7), ("r4_mini", 0, 0.8), ("r4_mini", 1, 0.9)]
    for index, (model, seed, acc) in enumerate(specs):
        write_run(tmp_path / str(index), model=model, seed=seed, test_acc=acc)
    files, skipped = find_run_files([str(tmp_path)], tmp_path)
    assert [f.parent.name for f in files] == ["0", "1", "2", "3"] and skipped == []
    runs = read_runs(files)
    # model.family, model.group and model.channels differ, all fixed by the model option
    assert differing_columns(runs) == ["model"]
    groups = group_runs(runs, ["model"])
    assert [g.label for g in groups] == [{"model": "cnn_mini"}, {"model": "r4_mini"}]
    record = groups[0].record(["test_acc"])
    assert record["n"] == 2 and record["test_acc_mean"] == pytest.approx(0.6)
    assert record["test_acc_std"] == pytest.approx(np.std([0.5, 0.7], ddof=1))
    assert record["best_epoch_min"] == record["best_epoch_max"] == 2
    assert record["train_time_s_mean"] == 20 and record["parameters"] == 1000
    assert [g.label["model"] for g in sort_groups(groups, "test_acc")] == ["r4_mini", "cnn_mini"]
    assert default_metrics(runs) == ["test_acc"]


def test_keys_that_differ_within_an_option_stay_columns(tmp_path):
    write_run(tmp_path / "a", model="cnn_mini", channels=(4, 8), variant="upright")
    write_run(tmp_path / "b", model="cnn_mini", channels=(8, 8), variant="upright")
    write_run(tmp_path / "c", model="r4_mini", variant="rotated")
    runs = read_runs(find_run_files([str(tmp_path)], tmp_path)[0])
    assert differing_columns(runs) == ["model", "model.channels", "data.variant"]
    labels = [g.label for g in group_runs(runs, ["model", "model.channels"])]
    assert labels[0] == {"model": "cnn_mini", "model.channels": "[4, 8]"}
    assert differing_columns(runs, ignore=["seed", "data"]) == ["model", "model.channels"]


def test_choices_come_from_the_hydra_record_of_older_files(tmp_path):
    """Run files written before they stored the config-group options: Hydra's record next to
    the file names them; without it the config keys themselves are the columns."""
    for name, model in (("a", "cnn_mini"), ("b", "r4_mini")):
        write_run(tmp_path / name, model=model, choices=False)
    runs = read_runs(find_run_files([str(tmp_path)], tmp_path)[0])
    assert differing_columns(runs) == ["model.family", "model.group", "model.channels"]
    hydra = tmp_path / "a" / ".hydra"
    hydra.mkdir()
    (hydra / "hydra.yaml").write_text(
        "hydra:\n  runtime:\n    choices:\n      model: cnn_mini\n      hydra/env: default\n"
    )
    assert read_run(tmp_path / "a" / "run.h5").choices == {"model": "cnn_mini"}


def test_only_finished_runs_are_averaged(tmp_path):
    write_run(tmp_path / "0", seed=0, test_acc=0.6)
    write_run(tmp_path / "1", seed=1, test_acc=0.8)
    write_run(tmp_path / "2", seed=2, status="failed", epochs=1)
    write_run(tmp_path / "3", seed=3, status="diverged", epochs=1)
    write_run(tmp_path / "4", seed=4, status="stopped", epochs=1)
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "run.h5").write_bytes(b"not hdf5")
    runs = read_runs(find_run_files([str(tmp_path)], tmp_path)[0])
    statuses = [run.status for run in runs]
    assert statuses == ["finished", "finished", "failed", "diverged", "stopped", "unreadable"]
    (group,) = group_runs(runs, [])
    assert len(group.runs) == 2 and group.values("test_acc").mean() == pytest.approx(0.7)
    assert [run.path.parent.name for run in excluded(runs)] == ["2", "3", "4", "5"]
    assert runs[4].epochs_done == 1 and math.isnan(runs[4].summary["test_acc"])


def test_a_run_still_training_is_read_live(tmp_path):
    writer = write_run(tmp_path / "live", epochs=1, planned=3, keep_open=True)
    try:
        (run,) = read_runs(find_run_files([str(tmp_path)], tmp_path)[0])
        assert run.status == "running" and run.epochs_done == 1
        writer.append("epoch", {"epoch": 2, "val_acc": 0.4})
        writer.flush()
        assert read_run(run.path).epochs_done == 2  # SWMR: the new epoch is visible
    finally:
        writer.close()


def test_bad_paths_name_the_value_and_the_fix(tmp_path):
    with pytest.raises(UserError, match="'nowhere' does not exist; pass run directories"):
        find_run_files(["nowhere"], tmp_path)
    with pytest.raises(UserError, match="'runs/\\*' matches nothing"):
        find_run_files(["runs/*"], tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="'empty' holds no run file of `symattn train`"):
        find_run_files(["empty"], tmp_path)
    with h5py.File(tmp_path / "other.h5", "w") as h5:
        h5["x"] = 1
    with pytest.raises(UserError, match="not a symattn run file"):
        find_run_files(["other.h5"], tmp_path)


def test_globs_and_unknown_group_keys(tmp_path):
    for name in ("s1", "s2", "t1"):
        write_run(tmp_path / name / "0", seed=int(name[1]))
    files, _ = find_run_files(["s*"], tmp_path)
    assert [f.parent.parent.name for f in files] == ["s1", "s2"]
    with pytest.raises(ConfigError, match="group_by: 'modle' is neither a config group"):
        check_columns(read_runs(files), ["modle"])


def test_markdown_keeps_the_rich_table(tmp_path):
    write_run(tmp_path / "0", model="cnn_mini", test_acc=0.5)
    write_run(tmp_path / "1", model="cnn_mini", seed=1, test_acc=0.7)
    runs = read_runs(find_run_files([str(tmp_path)], tmp_path)[0])
    table = groups_table(group_runs(runs, ["model"]), ["model"], ["test_acc"])
    lines = markdown(table).splitlines()
    assert lines[0] == "| model | n | test_acc (%) | best epoch | train s | params |"
    assert lines[1] == "|---|---:|---:|---:|---:|---:|"
    assert lines[2] == "| cnn_mini | 2 | 60.00 ± 14.14 | 2 | 20 ± 0 | 1,000 |"
