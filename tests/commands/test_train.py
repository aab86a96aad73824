"""``symattn train`` end to end: run file, W&B offline, sweeps, errors, kill and resume."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from symattn_cli.nn.gsa import cpp as gsa_cpp
from symattn_cli.train.runfile import (
    check_run_file,
    read_metrics,
    read_state,
    read_status,
    read_summary,
)
from tests.helpers import TINY_TRAIN, CodePayload, read_wandb_file, run_symattn, symattn_env


def only_run_file(root: Path) -> Path:
    files = sorted(root.rglob("run.h5"))
    assert len(files) == 1, files
    return files[0]


@pytest.mark.slow
def test_train_writes_run_file_and_offline_wandb(workdir):
    args = [a for a in TINY_TRAIN if not a.startswith("logger.")]
    result = run_symattn("train", *args, "trainer.epochs=2", "logger.mode=offline", cwd=workdir)
    assert result.returncode == 0, result.stderr
    path = only_run_file(workdir / "outputs")
    assert "test_acc" in result.stdout and f"run file: {path}" in result.stdout
    assert "epoch 2/2" in result.stdout  # plain progress, one line per epoch
    assert f"curves: {path.parent / 'curves.png'}" in result.stdout
    assert (path.parent / "curves.png").stat().st_size > 10_000
    assert not (path.parent / "attention.png").exists()  # a CNN has no attention to draw
    assert read_status(path) == "finished"
    summary = read_summary(path)
    assert 0.0 <= summary["test_acc"] <= 1.0 and summary["best_epoch"] in (1.0, 2.0)
    assert summary["parameters"] > 0
    metrics = read_metrics(path)
    assert metrics["epoch"].tolist() == [1.0, 2.0]
    with h5py.File(path, "r") as h5:
        assert "model:" in h5["config"].attrs["yaml"]
        assert h5["env"].attrs["torch"]
        assert len(h5["weights/best"]) > 0
    # W&B offline: a real run directory with the streamed history and summary.
    runs = list((path.parent / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    records = read_wandb_file(next(runs[0].glob("run-*.wandb")))
    epochs = [row for row in records["history"] if "val/acc" in row]
    assert [row["epoch"] for row in epochs] == ["1", "2"]
    assert all(float(row["val/loss"]) > 0 for row in epochs)
    assert any("curves/path" in row for row in records["history"])  # the plot, a W&B image
    final = {k: v for update in records["summary"] for k, v in update.items()}
    assert float(final["test_acc"]) == pytest.approx(summary["test_acc"])


@pytest.mark.slow
def test_multirun_gives_one_directory_per_job(workdir):
    result = run_symattn(
        "train", "-m", *TINY_TRAIN, "trainer.epochs=1", "trainer.max_steps_per_epoch=2",
        "seed=0,1", cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    files = sorted((workdir / "multirun").rglob("run.h5"))
    assert len(files) == 2 and files[0].parent != files[1].parent


def test_missing_resume_target_is_clear(symattn, workdir):
    result = symattn("train", "resume=nowhere", cwd=workdir)
    assert result.returncode == 2
    assert "no run file" in result.stderr and "Traceback" not in result.stderr


def test_foreign_resume_file_is_clear(symattn, workdir):
    foreign = workdir / "foreign.h5"
    with h5py.File(foreign, "w") as h5:
        h5["x"] = 1
    result = symattn("train", f"resume={foreign}", cwd=workdir)
    assert result.returncode == 2
    assert "not a symattn run file" in result.stderr and "Traceback" not in result.stderr


def test_a_resumed_run_keeps_its_config_and_takes_only_how_it_reports():
    """resume= with logger, progress or threads: taken; with what the run computes (the
    model, the epochs, the seed): refused by name when it differs, accepted when it does not."""
    from omegaconf import OmegaConf

    from symattn_cli.commands.train import resumed_config
    from symattn_cli.configs.base import TrainConfig
    from symattn_cli.errors import ConfigError

    stored = OmegaConf.structured(TrainConfig)
    given = OmegaConf.merge(stored, {"logger": {"mode": "disabled"},
                                     "trainer": {"progress": "plain", "threads": 1}})  # fmt: skip
    run = resumed_config(OmegaConf.merge(stored), given,
                         ["resume=x", "logger=disabled", "trainer.progress=plain",
                          "trainer.threads=1", f"trainer.epochs={stored.trainer.epochs}",
                          "hydra.run.dir=x"])  # fmt: skip
    assert run.logger.mode == "disabled" and run.trainer.progress == "plain"
    assert run.trainer.threads == 1 and run.trainer.epochs == stored.trainer.epochs
    assert run.seed == stored.seed
    # a preset (experiment=...) is judged by what it sets, the free keys aside
    same = OmegaConf.merge(stored, {"trainer": {"progress": "plain"}})
    resumed_config(OmegaConf.merge(stored), same, ["experiment=x", "trainer.progress=plain"])
    given = OmegaConf.merge(given, {"trainer": {"epochs": 3}, "seed": 7})
    with pytest.raises(ConfigError, match=r"; trainer.epochs=3, seed=7 would change it\. Drop"):
        resumed_config(OmegaConf.merge(stored), given,
                       ["resume=x", "trainer.epochs=3", "seed=7", "logger=disabled"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"; experiment=x would change it"):
        resumed_config(OmegaConf.merge(stored), given, ["experiment=x"])


def test_resume_with_another_model_is_refused(symattn, workdir):
    run = workdir / "run"
    trained = symattn("train", *TINY_TRAIN, "trainer.epochs=1", f"hydra.run.dir={run}",
                      cwd=workdir)  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    result = symattn("train", f"resume={run}", "model=cnn_mini", cwd=workdir)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "resume= continues a run with the config in its run file; model=cnn_mini would " \
           "change it" in result.stderr  # fmt: skip


def _plant_state(path: Path, payload: bytes) -> None:
    """Put ``payload`` into the run file's state slot 0 with its digest and make it current,
    as someone who edits a shared run file could (the checksums then hold: the state's
    decoder is what must refuse it)."""
    with h5py.File(path, "r+", libver="latest") as h5:
        blob = h5["state/blob0"]
        blob.resize((len(payload),))
        blob[:] = list(payload)
        h5["state/size0"][()] = len(payload)
        h5["state/digest0"][...] = list(hashlib.sha256(payload).digest())
        h5["state/current"][()] = 0


def _torch_save(value) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


@pytest.mark.slow
def test_resume_never_runs_code_from_the_run_file(workdir):
    """A run file's state is data: a pickle payload planted in it (raw, or inside a torch.save
    archive as format 1 stored states) is refused with one line, exit 2, and nothing of it
    runs; the file stays as it was. A format 1 state without a payload gets the same refusal,
    naming the format."""
    trained = run_symattn("train", *TINY_TRAIN, "trainer.epochs=1",
                          "trainer.max_steps_per_epoch=2", cwd=workdir)  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    genuine = only_run_file(workdir / "outputs")
    assert read_state(genuine)["epoch"] == 1  # the state this version writes reads back
    marker = workdir / "payload-ran"
    planted = {
        "pickle": (pickle.dumps({"epoch": CodePayload(marker)}), "not one symattn wrote"),
        "torch.save": (_torch_save({"epoch": CodePayload(marker)}), "format 1"),
        "format 1": (_torch_save({"epoch": 1, "step": 2}), "format 1"),
    }
    for name, (payload, reason) in planted.items():
        run = workdir / name.replace(" ", "_") / "run.h5"
        run.parent.mkdir()
        shutil.copy(genuine, run)
        _plant_state(run, payload)
        before = hashlib.sha256(run.read_bytes()).hexdigest()
        result = run_symattn("train", f"resume={run.parent}", cwd=workdir)
        assert result.returncode == 2, (name, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("symattn: error:"), (name, lines)
        assert str(run) in lines[0] and reason in lines[0] and "resume=" in lines[0], lines
        assert not marker.exists(), f"the {name} payload ran"
        assert hashlib.sha256(run.read_bytes()).hexdigest() == before  # not touched
        check_run_file(run)
        assert read_status(run) == "finished" and read_metrics(run)["epoch"].tolist() == [1.0]


def test_diverged_run_says_what_to_change_and_keeps_its_file(symattn, workdir):
    args = [*TINY_TRAIN, "trainer.optimizer=sgd", "trainer.lr=1e30"]
    result = symattn("train", *args, cwd=workdir)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "loss became nan" in result.stderr and "Lower trainer.lr" in result.stderr
    path = only_run_file(workdir / "outputs")
    assert read_status(path) == "diverged"
    assert not (path.parent / "curves.png").exists()  # no finished epoch to draw


KILL_ARGS = [*TINY_TRAIN, "data.num_train=320", "trainer.epochs=4", "trainer.log_every_steps=2"]
# The default model at a small width: the attention kernel and augmented digits too.
GSA_KILL_ARGS = [*(a for a in KILL_ARGS if not a.startswith("model")), "model=gsa_mini",
                 "model.channels=8"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.usefixtures("native_attention_core")
@pytest.mark.parametrize("args", [KILL_ARGS, GSA_KILL_ARGS], ids=["cnn", "gsa_mini"])
def test_sigkill_mid_epoch_then_resume_matches_uninterrupted_run(workdir, args):
    reference = run_symattn("train", *args, f"hydra.run.dir={workdir / 'ref'}", cwd=workdir)
    assert reference.returncode == 0, reference.stderr
    # the CPU budget (every core by default), and for a GSA-Net the attention backend
    line = next(x for x in reference.stdout.splitlines() if x.startswith("model: "))
    if "model=gsa_mini" in args:
        assert " threads, attention backend cpp)" in line or not gsa_cpp.enabled(), line
    else:
        assert " threads)" in line and "attention" not in line, line
    expected = read_summary(workdir / "ref" / "run.h5")

    killed_dir = workdir / "killed"
    process = subprocess.Popen(
        [sys.executable, "-m", "symattn_cli", "train", *args, f"hydra.run.dir={killed_dir}"],
        cwd=workdir,
        env=symattn_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    run_file = killed_dir / "run.h5"
    deadline = time.time() + 240
    try:
        # Wait for the first finished epoch plus a few logged steps of the second one.
        while time.time() < deadline and process.poll() is None:
            if run_file.exists():
                try:
                    epochs = len(read_metrics(run_file)["epoch"])
                    steps = read_metrics(run_file, "step")["epoch"].tolist()
                except (OSError, KeyError):
                    epochs, steps = 0, []
                if epochs >= 1 and steps.count(float(epochs + 1)) >= 2:
                    break
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
    assert read_status(run_file) == "running"
    done = len(read_metrics(run_file)["epoch"])
    assert 1 <= done < 4, "the kill must land before the run finished"

    resumed = run_symattn("train", f"resume={killed_dir}", cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stdout
    assert read_status(run_file) == "finished"
    assert read_metrics(run_file)["epoch"].tolist() == [1.0, 2.0, 3.0, 4.0]
    got = read_summary(run_file)
    for key in ("test_acc", "test_loss", "best_val_acc", "best_epoch"):
        assert got[key] == pytest.approx(expected[key], rel=1e-9, abs=1e-12), key


@pytest.mark.slow
def test_torchrun_data_parallel_on_cpu(workdir):
    """Two processes (gloo): each trains on half of every epoch; rank 0 alone writes."""
    run_dir = workdir / "ddp"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "symattn_cli",
         "train", *TINY_TRAIN, "data.num_train=320", "trainer.epochs=2",
         f"hydra.run.dir={run_dir}"],
        cwd=workdir, env=symattn_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("test_acc") == 1  # only rank 0 reports
    metrics = read_metrics(run_dir / "run.h5")
    assert metrics["step"].tolist() == [10.0, 20.0]  # 320 / 2 processes / batch 16
    assert read_status(run_dir / "run.h5") == "finished"


def test_profile_names_where_the_run_spends_its_time(symattn, workdir):
    """``trainer.profile=true``: profile.md holds every part of the step with its seconds and
    share of the wall time, the parts add up to the wall time, and the GSA-Net's attention
    kernel (or, without the C++ kernel, its PyTorch operators) takes a share of the step."""
    out = workdir / "profiled"
    args = [a for a in TINY_TRAIN if not a.startswith("model")]
    result = symattn(
        "train", *args, "model=gsa_mini", "trainer.epochs=1", "trainer.max_steps_per_epoch=3",
        "trainer.profile=true", f"hydra.run.dir={out}", cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = (out / "profile.md").read_text()
    assert "CPU s per wall s" in text and text in result.stdout
    from symattn_cli.train.profile import PARTS

    rows = {
        line.split("|")[1].strip(): float(line.split("|")[2])
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| part")
    }
    assert set(rows) == set(PARTS)
    wall = float(text.split("wall ")[1].split(" s")[0])
    assert sum(rows.values()) == pytest.approx(wall, rel=0.05)
    kernel = rows["attention kernel forward"] + rows["attention kernel backward"]
    assert kernel > 0 or not gsa_cpp.enabled()
    # (the optimiser's part, three updates of one flat tensor, can round to 0 in the table)
    assert rows["1x1 projections"] > 0


def test_addition_recipe_end_to_end_with_a_tiny_budget(symattn, workdir):
    run = workdir / "add"
    result = symattn(
        "train", "experiment=ka_addition", "data.num_train=64", "data.num_val=16",
        "data.num_test=16", "data.max_digits=3", "model.d_model=8", "model.heads=2",
        "model.layers=1", "model.mlp_hidden=16", "trainer.epochs=1",
        "trainer.max_steps_per_epoch=2", "trainer.batch_size=32", "trainer.progress=plain",
        "logger.mode=disabled", f"hydra.run.dir={run}", cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = read_summary(run / "run.h5")
    for split in ("test", "test_long", "test_longer"):
        assert 0.0 <= summary[f"{split}_exact"] <= summary[f"{split}_acc"] <= 1.0
    assert "test_longer_exact" in result.stdout
