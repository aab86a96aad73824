"""Run files made without training: a config, a few epochs and a summary, any status."""

from __future__ import annotations

import socket
from pathlib import Path

import h5py
import yaml

from symattn_cli.train.runfile import RunFile

EPOCH_METRICS = ("epoch", "step", "time_s", "lr", "train_loss", "train_acc", "val_loss", "val_acc")
SUMMARY_METRICS = ("test_acc", "test_loss", "best_epoch", "best_val_acc", "parameters",
                   "train_time_s")  # fmt: skip
DEAD_WRITER = f"{socket.gethostname()}:4194999"  # above Linux's largest pid: no such process


def write_run(
    directory: Path,
    *,
    model: str = "cnn_mini",
    seed: int = 0,
    test_acc: float = 0.5,
    status: str = "finished",
    epochs: int = 2,
    planned: int = 2,
    variant: str = "rotated",
    channels: tuple[int, ...] | None = None,
    choices: bool = True,
    keep_open: bool = False,
    num_train: int | None = None,
    train_time_s: float | None = None,
):
    """``<directory>/run.h5`` as ``symattn train`` writes it; returns the open writer with
    ``keep_open`` (a run still training), else the path; ``train_time_s`` defaults to 10 s
    an epoch."""
    family = "cnn" if "cnn" in model else "gsa"
    config = {
        "model": {"family": family, "group": model.split("_")[0],
                  "channels": list(channels or ((16, 20, 28) if family == "cnn" else (16,)))},
        "data": {"name": "rotmnist_mini", "variant": variant},
        "trainer": {"epochs": planned, "progress": "plain"},
        "logger": {"mode": "disabled"},
        "seed": seed,
    }  # fmt: skip
    if num_train is not None:
        config["data"]["num_train"] = num_train
    run = RunFile.create(
        Path(directory) / "run.h5",
        command="train",
        config_yaml=yaml.safe_dump(config, sort_keys=False),
        env={"git_commit": "0123456789abcdef", "git_dirty": False},
        epoch_metrics=EPOCH_METRICS,
        step_metrics=("step", "loss"),
        summary_metrics=SUMMARY_METRICS,
        choices=yaml.safe_dump({"model": model, "data": "rotmnist_mini"}) if choices else "",
    )
    for epoch in range(1, epochs + 1):
        run.append(
            "epoch",
            {
                "epoch": epoch,
                "step": 10 * epoch,
                "time_s": 1.0,
                "train_loss": 2.0 / epoch,
                "val_acc": test_acc * epoch / epochs,
            },
        )
    run.flush()
    if keep_open:
        return run
    if status == "finished":
        run.set_summary({"test_acc": test_acc, "test_loss": 1.0 - test_acc, "best_epoch": epochs,
                         "best_val_acc": test_acc, "parameters": 1000.0,
                         "train_time_s": 10.0 * epochs if train_time_s is None
                         else train_time_s})  # fmt: skip
    run.set_status("running" if status == "stopped" else status)
    run.close()
    if status == "stopped":  # killed: the file says running, its writer is gone
        with h5py.File(run.path, "r+") as h5:
            h5["writer"][()] = DEAD_WRITER
    return run.path
