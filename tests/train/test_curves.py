"""Learning curves drawn from a run file."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.image import imread

from symattn_cli.train.curves import plot_learning_curves, plot_run, step_epochs
from symattn_cli.train.runfile import RunFile


def write_run(path, task_scores=("acc",), epochs=3, steps_per_epoch=10, log_every=4):
    names = ["epoch", "step", "lr", "time_s"] + [
        f"{split}_{m}" for split in ("train", "val") for m in ("loss", *task_scores)
    ]
    run = RunFile.create(
        path, command="train", config_yaml="seed: 0\n", env={},
        epoch_metrics=names, step_metrics=["step", "epoch", "loss", "lr"],
        summary_metrics=["test_loss"] + [f"test_{m}" for m in task_scores], weights={},
    )  # fmt: skip
    rng = np.random.default_rng(0)
    for step in range(log_every, epochs * steps_per_epoch + 1, log_every):
        run.append("step", {"step": step, "epoch": (step - 1) // steps_per_epoch + 1,
                            "loss": 2.0 / step, "lr": 1e-3})  # fmt: skip
    for epoch in range(1, epochs + 1):
        row = {"epoch": epoch, "step": epoch * steps_per_epoch, "lr": 1e-3, "time_s": 1.0}
        for split in ("train", "val"):
            row[f"{split}_loss"] = 2.0 / epoch
            row.update({f"{split}_{m}": rng.uniform() for m in task_scores})
        run.append("epoch", row)
    run.set_summary({"test_loss": 0.7, **{f"test_{m}": 0.9 for m in task_scores}})
    run.close()
    return path


def test_step_epochs_interpolates_between_epoch_ends():
    epochs = {"epoch": np.array([1.0, 2.0]), "step": np.array([10.0, 20.0])}
    np.testing.assert_allclose(step_epochs(np.array([5.0, 10.0, 15.0]), epochs), [0.5, 1.0, 1.5])
    # steps logged after the last finished epoch (a killed run) have no epoch yet
    assert np.isnan(step_epochs(np.array([25.0]), epochs)).all()


@pytest.mark.parametrize("scores", [("acc",), ("acc", "exact")])
def test_curves_of_a_run_file(tmp_path, scores):
    path = plot_run(write_run(tmp_path / "run.h5", scores), title="a run")
    assert path == tmp_path / "curves.png"
    image = imread(path)
    assert image.shape[0] > 300 and image.shape[1] > 1000  # three panels side by side
    assert image[..., :3].std() > 0.05  # something is drawn


def test_no_curves_before_the_first_epoch(tmp_path):
    empty = {"epoch": np.array([]), "step": np.array([])}
    assert plot_learning_curves(empty, {}, {}, tmp_path / "curves.png") is None
    assert not (tmp_path / "curves.png").exists()
