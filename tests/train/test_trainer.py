"""The training loop on a tiny synthetic task: optimisers, schedules, divergence, selection."""

from __future__ import annotations

import io
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from symattn_cli.data.base import DataBundle, DataSpec
from symattn_cli.errors import ConfigError
from symattn_cli.train.progress import Progress
from symattn_cli.train.runfile import NullRunFile, RunFile, read_metrics, read_state, read_weights
from symattn_cli.train.settings import TrainSettings
from symattn_cli.train.tracking import Tracker
from symattn_cli.train.trainer import DivergedError, Trainer, metric_names


def bundle(n: int = 64) -> DataBundle:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=generator)
    y = (x[:, 0] > 0).long()
    split = TensorDataset(x, y)
    spec = DataSpec(task="classify", num_classes=2)
    return DataBundle(train=split, val=split, test=split, spec=spec)


def make_trainer(tmp_path, model=None, **settings) -> Trainer:
    data = bundle()
    model = model or nn.Linear(4, 2)
    names = metric_names("classify", {})
    run_file = RunFile.create(
        tmp_path / "run.h5",
        command="train",
        config_yaml="",
        env={},
        epoch_metrics=names["epoch"],
        step_metrics=names["step"],
        summary_metrics=names["summary"],
        weights={k: v.numpy() for k, v in model.state_dict().items()},
    )
    options = TrainSettings(batch_size=16, progress="none", device="cpu", **settings)
    return Trainer(model, data, options, run_file=run_file, tracker=Tracker(None), seed=0)


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd"])
def test_optimisers_learn_a_separable_task(tmp_path, optimizer):
    trainer = make_trainer(tmp_path, optimizer=optimizer, lr=0.1, epochs=15)
    summary = trainer.fit()
    trainer.run_file.close()
    assert summary["test_acc"] >= 0.9
    assert len(read_metrics(tmp_path / "run.h5")["epoch"]) == 15


def test_the_optimiser_updates_one_flat_tensor_and_saves_per_parameter(tmp_path):
    """The trainer's optimiser holds one tensor (the model's parameters are views into it),
    and the state in the run file lists the model's parameters one by one."""
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    trainer = make_trainer(tmp_path, model=model, epochs=2)
    (group,) = trainer.optimizer.param_groups
    assert len(group["params"]) == 1 and group["params"][0].numel() == 23
    trainer.fit()
    trainer.run_file.close()
    saved = read_state(tmp_path / "run.h5")["optimizer"]
    assert len(saved["state"]) == 4
    for index, p in enumerate(model.parameters()):
        assert tuple(saved["state"][index]["exp_avg"].shape) == tuple(p.shape)


def test_warmup_cosine_schedule(tmp_path):
    trainer = make_trainer(tmp_path, schedule="cosine", warmup_epochs=1, epochs=4, lr=1.0)
    factor = trainer.scheduler.lr_lambdas[0]
    steps = trainer.steps_per_epoch  # 4 batches of 16
    assert factor(0) == pytest.approx(1 / steps)
    assert factor(steps - 1) == pytest.approx(1.0)
    assert factor(steps) == pytest.approx(1.0)
    assert factor(4 * steps) == pytest.approx(0.0, abs=1e-12)
    middle = steps + (3 * steps) // 2
    assert factor(middle) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    trainer.run_file.close()


def test_gradient_clipping_bounds_the_update(tmp_path):
    model = nn.Linear(4, 2)
    trainer = make_trainer(tmp_path, model=model, optimizer="sgd", momentum=0.0, lr=1.0,
                           grad_clip=1e-3, epochs=1, max_steps_per_epoch=1)  # fmt: skip
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    trainer.fit()
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    step = float(torch.linalg.vector_norm((after - before).double()))
    # The unclipped gradient of this loss is O(1); clipped, the step has norm 1e-3 (up to the
    # float32 rounding of weights of size ~0.5, ~1e-7 absolute).
    assert step == pytest.approx(1e-3, rel=1e-3)
    trainer.run_file.close()


class Exploding(nn.Module):
    """Finite for the first epoch, then NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        out = self.linear(x)
        return out * float("nan") if self.training and self.calls > 4 else out


def test_non_finite_loss_stops_and_keeps_last_good_state(tmp_path):
    trainer = make_trainer(tmp_path, model=Exploding(), epochs=3)
    with pytest.raises(DivergedError, match="loss became nan at epoch 2"):
        trainer.fit()
    trainer.run_file.close()
    state = read_state(tmp_path / "run.h5")
    assert state["epoch"] == 1
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    weights = read_weights(tmp_path / "run.h5")
    assert all(np.isfinite(w).all() for w in weights.values())


def test_best_weights_are_selected_on_validation(tmp_path):
    trainer = make_trainer(tmp_path, lr=0.1, epochs=5)
    trainer.fit()
    trainer.run_file.close()
    metrics = read_metrics(tmp_path / "run.h5")
    best = int(np.argmax(metrics["val_acc"])) + 1
    assert trainer.best_epoch == best
    saved = read_weights(tmp_path / "run.h5")
    np.testing.assert_array_equal(saved["weight"], trainer.best_state["weight"].numpy())


def test_amp_is_ignored_on_cpu_and_says_so(tmp_path):
    trainer = make_trainer(tmp_path, amp=True, epochs=1)
    assert trainer.use_amp is False
    trainer.run_file.close()
    stream = io.StringIO()
    with Progress("plain", stream=stream) as progress:
        options = TrainSettings(batch_size=16, device="cpu", amp=True)
        run_file = NullRunFile()
        Trainer(nn.Linear(4, 2), bundle(), options, run_file=run_file, tracker=Tracker(None),
                progress=progress)  # fmt: skip
    assert "trainer.amp=true: mixed precision runs on CUDA only" in stream.getvalue()


def test_bad_settings_name_the_value():
    with pytest.raises(ConfigError, match="trainer.schedule='linear'"):
        TrainSettings(schedule="linear").check()
    with pytest.raises(ConfigError, match="trainer.device='tpu'"):
        TrainSettings(device="tpu").check()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"log_every_steps": 0}, r"trainer.log_every_steps=0 must be at least 1"),
        ({"threads": -1}, r"trainer.threads=-1 must be >= 0 \(0 uses every core\)"),
        ({"num_workers": -1}, r"trainer.num_workers=-1 must be >= 0"),
        ({"max_steps_per_epoch": -2}, r"trainer.max_steps_per_epoch=-2 must be >= 0"),
        ({"warmup_epochs": -0.5}, r"trainer.warmup_epochs=-0.5 must be >= 0"),
        ({"weight_decay": -1e-4}, r"trainer.weight_decay=-0.0001 must be >= 0"),
        ({"momentum": -0.9}, r"trainer.momentum=-0.9 must be >= 0"),
        ({"min_lr_ratio": 1.5}, r"trainer.min_lr_ratio=1.5 .* give a value from 0 to 1"),
    ],
)
def test_out_of_range_settings_name_the_value_and_the_range(values, message):
    with pytest.raises(ConfigError, match=message):
        TrainSettings(**values).check()
    TrainSettings(**{key: 0 for key in values if key != "log_every_steps"}).check()  # the edge


def test_plain_progress_prints_one_line_per_epoch():
    stream = io.StringIO()
    with Progress("auto", stream=stream) as progress:  # not a TTY: plain
        assert progress.mode == "plain"
        progress.start_epoch(1, 2, 3)
        progress.step()
        progress.end_epoch(1, 2, {"val_acc": 0.5})
    assert stream.getvalue() == "epoch 1/2 val_acc=0.5\n"


def test_rich_progress_draws_a_bar():
    stream = io.StringIO()
    with Progress("rich", stream=stream) as progress:
        progress.start_epoch(1, 1, 2)
        progress.step("loss 1.0")
        progress.step("loss 0.5")
        progress.end_epoch(1, 1, {"val_acc": 0.5})
    text = stream.getvalue()
    assert "epoch 1/1" in text and "2/2" in text  # the bar's M/N column, completed


def _loaded_after(code: str, module: str) -> bool:
    """Whether ``module`` is imported after ``code`` runs in a fresh Python process."""
    code += f"import sys\nprint({module!r} in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


def test_seeding_turns_on_deterministic_algorithms_without_loading_the_compiler():
    """The eager flag is what a run needs; torch's own switch also imports its compiler,
    seconds of every run's start."""
    code = (
        "import torch\n"
        "from symattn_cli.train.trainer import seed_everything\n"
        "seed_everything(3)\n"
        "assert torch.are_deterministic_algorithms_enabled()\n"
        "assert torch.is_deterministic_algorithms_warn_only_enabled()\n"
    )
    assert not _loaded_after(code, "torch._inductor")


def test_training_and_resuming_do_not_load_the_compiler():
    """torch wraps an optimiser's step, state_dict, load_state_dict, zero_grad and
    add_param_group so that torch.compile stays out of them, and each wrapper imports
    torch._dynamo on its first call: seconds of every run's start. The trainer's optimiser
    runs them unwrapped: two epochs with each optimiser, and a resume from the saved state,
    leave it unloaded."""
    code = (
        "import torch\n"
        "from torch import nn\n"
        "from torch.utils.data import TensorDataset\n"
        "from symattn_cli.data.base import DataBundle, DataSpec\n"
        "from symattn_cli.train.runfile import NullRunFile\n"
        "from symattn_cli.train.settings import TrainSettings\n"
        "from symattn_cli.train.tracking import Tracker\n"
        "from symattn_cli.train.trainer import Trainer\n"
        "x = torch.randn(32, 4)\n"
        "split = TensorDataset(x, (x[:, 0] > 0).long())\n"
        "data = DataBundle(train=split, val=split, test=split,\n"
        "                  spec=DataSpec(task='classify', num_classes=2))\n"
        "for name in ('adam', 'adamw', 'sgd'):\n"
        "    options = TrainSettings(batch_size=16, progress='none', device='cpu', epochs=2,\n"
        "                            optimizer=name)\n"
        "    def trainer():\n"
        "        return Trainer(nn.Linear(4, 2), data, options, run_file=NullRunFile(),\n"
        "                       tracker=Tracker(None), seed=0)\n"
        "    first = trainer()\n"
        "    first.fit()\n"
        "    trainer().load_state(first.state())\n"
    )
    assert not _loaded_after(code, "torch._dynamo")
