"""Learning curves drawn from a run file."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.image import imread

from symattn_cli.train.curves import epoch_plotter, plot_learning_curves, plot_run, step_epochs
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


def test_epoch_plotter_draws_from_the_open_run_file(tmp_path):
    """The trainer's per-epoch callback reads the writer's own handle (no second open)."""
    path = write_run(tmp_path / "run.h5")
    run = RunFile.reopen(path)
    try:
        epoch_plotter(run, tmp_path / "live.png", title="live")()
    finally:
        run.close()
    assert imread(tmp_path / "live.png").shape[1] > 1000
    assert not list(tmp_path.glob(".*partial*"))  # written aside, then moved into place


def test_epoch_plotter_fits_the_layout_once(tmp_path, monkeypatch):
    """Redraws place the panels where the first redraw's fitted layout put them: the same
    picture for the same metrics, the labels measured once."""
    from matplotlib.figure import Figure

    fits = []
    fit = Figure.tight_layout
    monkeypatch.setattr(Figure, "tight_layout", lambda self, *a, **k: fits.append(fit(self)))
    run = RunFile.reopen(write_run(tmp_path / "run.h5"))
    try:
        draw = epoch_plotter(run, tmp_path / "live.png", title="live")
        draw()
        first = imread(tmp_path / "live.png")
        draw()
    finally:
        run.close()
    assert len(fits) == 1
    np.testing.assert_array_equal(imread(tmp_path / "live.png"), first)


def test_epoch_plotter_warns_once_and_lets_training_go_on(tmp_path, capsys):
    class Broken:
        calls = 0

        def metrics(self, kind):
            Broken.calls += 1
            raise OSError("disk full")

    draw = epoch_plotter(Broken(), tmp_path / "curves.png")
    draw()
    draw()
    assert Broken.calls == 1
    assert capsys.readouterr().err.count("learning curves not drawn (disk full)") == 1


def test_trainer_calls_on_epoch_after_each_epoch(tmp_path):
    from tests.train.test_trainer import make_trainer

    seen = []
    trainer = make_trainer(tmp_path, epochs=3)
    trainer.on_epoch = lambda: seen.append(trainer.run_file.num_rows("epoch"))
    trainer.fit()
    trainer.run_file.close()
    assert seen == [1, 2, 3]  # each call sees its epoch's row already written
