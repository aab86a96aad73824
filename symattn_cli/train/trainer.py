"""The training loop: optimiser, schedule, validation, best weights, test, resume.

Selection happens on validation only: the best-on-validation weights are kept (in memory and in
the run file) and the test split is evaluated once, at the end, with those weights. Every epoch
ends by writing the full resumable state to the run file, so a killed run continues from its
last finished epoch and, on CPU, reaches the same final metrics as an uninterrupted run.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import random
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.profiler import record_function
from torch.utils.data import DataLoader, DistributedSampler

from symattn_cli.data.base import IGNORE_INDEX, DataBundle
from symattn_cli.errors import ConfigError, UserError
from symattn_cli.nn.gsa.core import attention_backends
from symattn_cli.train.distributed import World, sum_across
from symattn_cli.train.flat import FlatParameters
from symattn_cli.train.progress import Progress
from symattn_cli.train.runfile import RunFile
from symattn_cli.train.settings import TrainSettings
from symattn_cli.train.tracking import Tracker

# Optimizer methods that torch wraps to keep torch.compile from tracing into them; each
# wrapper imports torch._dynamo on its first call.
_COMPILER_WRAPPED = ("add_param_group", "state_dict", "load_state_dict", "zero_grad")


@functools.cache
def eager(kind: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``kind`` (a torch optimiser class) with the methods the trainer calls run as written,
    without torch's wrappers that keep torch.compile out of them: those import torch._dynamo
    (the compiler, a large import) on the first call, and the trainer compiles nothing.
    ``step`` keeps what its wrapper does besides: gradients off unless the optimiser is
    ``differentiable``. The same updates, state and state dicts as ``kind``; a torch without
    the wrappers gives ``kind``'s own methods."""
    raw_step = inspect.unwrap(kind.step)

    def step(self, closure=None):
        with torch.set_grad_enabled(self.defaults.get("differentiable", False)):
            return raw_step(self, closure)

    methods = {name: inspect.unwrap(getattr(kind, name)) for name in _COMPILER_WRAPPED}
    return type(kind.__name__, (kind,), {**methods, "step": step, "__module__": __name__})


class DivergedError(UserError):
    """The loss became NaN or infinite; the run file keeps the last good state."""


def seed_everything(seed: int, *, deterministic: bool = True) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if deterministic:
        deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def deterministic_algorithms(mode: bool, *, warn_only: bool) -> None:
    """``torch.use_deterministic_algorithms(mode, warn_only=warn_only)``, which also sets the
    compiler's flag and so imports the compiler (seconds per process). symattn compiles
    nothing: unless the compiler is already loaded, only the eager flag is set."""
    if "torch._inductor.config" in sys.modules or not hasattr(
        torch._C, "_set_deterministic_algorithms"
    ):
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    else:
        torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={name!r} but no CUDA device is available; use cpu")
    return device


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def metric_names(task: str, extra_tests: Mapping[str, Any]) -> dict[str, list[str]]:
    """Names of the epoch, step and summary metrics a run of this task writes."""
    scores = ["loss", "acc"] + (["exact"] if task == "tokens" else [])
    epoch = ["epoch", "step", "lr", "time_s"]
    epoch += [f"{split}_{m}" for split in ("train", "val") for m in scores]
    summary = ["best_epoch", "parameters", "train_time_s"]
    summary += [f"best_val_{m}" for m in scores]
    summary += [f"{split}_{m}" for split in ("test", *extra_tests) for m in scores]
    return {"epoch": epoch, "step": ["step", "epoch", "loss", "lr"], "summary": summary}


@dataclass
class Batch:
    inputs: torch.Tensor
    targets: torch.Tensor


def _score(task: str, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Summed loss and counts for one batch (summed so that epoch means are exact)."""
    if task == "classify":
        loss = nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
        correct = (logits.argmax(-1) == targets).sum()
        return {"loss": loss, "correct": correct, "count": torch.tensor(targets.numel())}
    # tokens: logits (B, n, V), targets (B, n) with IGNORE_INDEX where nothing is read
    mask = targets != IGNORE_INDEX  # (B, n)
    loss = nn.functional.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    hit = (logits.argmax(-1) == targets) | ~mask  # (B, n)
    return {
        "loss": loss,
        "correct": (hit & mask).sum(),
        "count": mask.sum(),
        "exact": hit.all(dim=1).sum(),
        "sequences": torch.tensor(targets.shape[0]),
    }


class Trainer:
    """Fits ``model`` on ``data`` with ``settings``; writes to ``run_file`` and ``tracker``."""

    def __init__(
        self,
        model: nn.Module,
        data: DataBundle,
        settings: TrainSettings,
        *,
        run_file: RunFile,
        tracker: Tracker,
        seed: int = 0,
        progress: Progress | None = None,
        world: World | None = None,
        on_epoch: Callable[[], None] | None = None,
    ) -> None:
        settings.check()
        self.world = world or World()
        self.settings = settings
        self.data = data
        self.task = data.spec.task
        self.seed = seed
        self.device = resolve_device(settings.device)
        self.model = model.to(self.device)
        # one flat tensor (and gradient) per dtype for the optimiser; before DDP sees them
        self.flat = FlatParameters(p for p in self.model.parameters() if p.requires_grad)
        self.net = self.model  # what forward passes go through: DDP-wrapped under torchrun
        if self.world.distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.net = nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        if settings.compile:  # one graph per mode (train, eval); the weights stay self.model's
            self.net = torch.compile(self.net)
        self.run_file = run_file
        self.tracker = tracker
        self.progress = progress or Progress("none")
        self.on_epoch = on_epoch  # called after each epoch's row and state are in the run file
        self.use_amp = settings.amp and self.device.type == "cuda"
        if settings.amp and not self.use_amp:
            self.progress.message(
                f"trainer.amp=true: mixed precision runs on CUDA only; this {self.device.type} "
                "run trains in float32"
            )
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.use_amp)
        self.optimizer = self._make_optimizer()
        self.steps_per_epoch = self._steps_per_epoch()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor())
        self.epoch = 0  # finished epochs
        self.step = 0  # optimiser steps taken
        self.best_metric = -math.inf
        self.best_epoch = 0
        self.best_state: dict[str, torch.Tensor] | None = None
        self.best_scores: dict[str, float] = {}
        self.train_time = 0.0

    # -- construction helpers ---------------------------------------------------------------

    def _make_optimizer(self) -> torch.optim.Optimizer:
        """The optimiser over the flat parameters (:mod:`symattn_cli.train.flat`: one tensor
        per dtype), with torch's fused implementation where the torch version and the device
        have one, else the default one; the update is the same."""
        s = self.settings
        params = self.flat.tensors
        if s.optimizer in ("adam", "adamw"):
            kind = eager(torch.optim.Adam if s.optimizer == "adam" else torch.optim.AdamW)
            make = functools.partial(kind, params, lr=s.lr, weight_decay=s.weight_decay)
        else:
            kind = eager(torch.optim.SGD)
            make = functools.partial(
                kind, params, lr=s.lr, momentum=s.momentum, weight_decay=s.weight_decay
            )
        try:
            return make(fused=True)
        except RuntimeError:  # no fused kernel for these parameters' device in this torch
            return make()

    def _steps_per_epoch(self) -> int:
        per_process = math.ceil(len(self.data.train) / self.world.size)
        steps = math.ceil(per_process / self.settings.batch_size)
        if self.settings.max_steps_per_epoch > 0:
            steps = min(steps, self.settings.max_steps_per_epoch)
        return steps

    def _lr_factor(self) -> Callable[[int], float]:
        s = self.settings
        total = s.epochs * self.steps_per_epoch
        warmup = int(round(s.warmup_epochs * self.steps_per_epoch))

        def factor(step: int) -> float:
            if warmup > 0 and step < warmup:
                return (step + 1) / warmup
            if s.schedule == "constant":
                return 1.0
            progress = (step - warmup) / max(1, total - warmup)
            cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
            return s.min_lr_ratio + (1.0 - s.min_lr_ratio) * cosine

        return factor

    def _loader(self, dataset: Any, *, train: bool, epoch: int = 0) -> DataLoader:
        # Shuffling is seeded from (seed, epoch): replaying an epoch after a resume draws the
        # same batches without storing any sampler state.
        generator, sampler = None, None
        if train and self.world.distributed:
            sampler = DistributedSampler(
                dataset, num_replicas=self.world.size, rank=self.world.rank, seed=self.seed
            )
            sampler.set_epoch(epoch)
        elif train:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return DataLoader(
            dataset,
            batch_size=self.settings.batch_size if train else self.settings.eval_batch_size,
            shuffle=train and sampler is None,
            sampler=sampler,
            generator=generator,
            collate_fn=self.data.collate,
            num_workers=self.settings.num_workers,
            drop_last=False,
        )

    # -- state ----------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.flat.per_parameter(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "best_metric": self.best_metric,
            "best_epoch": self.best_epoch,
            "best_state": self.best_state,
            "best_scores": self.best_scores,
            "train_time": self.train_time,
            "rng_torch": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "rng_numpy": np.random.get_state(),
            "rng_python": random.getstate(),
            "tracker_id": self.tracker.run_id,
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.step = state["step"]
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(self.flat.flat_state(state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.best_metric = state["best_metric"]
        self.best_epoch = state["best_epoch"]
        self.best_state = state["best_state"]
        self.best_scores = dict(state["best_scores"])
        self.train_time = state["train_time"]
        torch.set_rng_state(state["rng_torch"])
        if state.get("rng_cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        np.random.set_state(state["rng_numpy"])
        random.setstate(state["rng_python"])
        # Rows written after this state (a partly finished epoch) are replayed, and the best
        # weights are those of the state (a later epoch may have written others before it
        # was stopped).
        self.run_file.truncate("epoch", self.epoch)
        self.run_file.truncate("step", self.run_file.rows_until("step", "step", self.step))
        if self.best_state is not None:
            self.run_file.write_weights(_numpy_state(self.best_state))

    # -- loop -------------------------------------------------------------------------------------

    def _forward(self, inputs: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=self.device.type, enabled=self.use_amp):
            return self.net(inputs)

    def _train_epoch(self, epoch: int) -> dict[str, float]:
        self.net.train()
        totals: dict[str, float] = {}
        loader = iter(self._loader(self.data.train, train=True, epoch=epoch))
        self.progress.start_epoch(epoch + 1, self.settings.epochs, self.steps_per_epoch)
        for _ in range(self.steps_per_epoch):
            # record_function: the phases a profile of the step names (benchmark preset=profile)
            with record_function("train.data"):
                batch = next(loader, None)
                if batch is None:
                    break
                inputs, targets = batch[0].to(self.device), batch[1].to(self.device)
            with record_function("train.forward"):
                logits = self._forward(inputs)
                scores = _score(self.task, logits, targets)
                loss = scores["loss"] / scores["count"].clamp(min=1)
            if not torch.isfinite(loss):
                raise DivergedError(
                    f"loss became {loss.item()} at epoch {epoch + 1}, step {self.step + 1}; "
                    "the run file keeps the last finished epoch. Lower trainer.lr, set "
                    "trainer.grad_clip (e.g. 1.0) or turn off trainer.amp"
                )
            with record_function("train.backward"):
                self.flat.zero_grad()
                self.scaler.scale(loss).backward()
                self.flat.check()
            with record_function("train.optimizer"):
                if self.settings.grad_clip > 0:
                    self.scaler.unscale_(self.optimizer)
                    nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.scheduler.step()
            self.step += 1
            with record_function("train.logging"):
                for key, value in scores.items():
                    totals[key] = totals.get(key, 0.0) + float(value.detach())
                if self.step % self.settings.log_every_steps == 0:
                    row = {
                        "step": self.step,
                        "epoch": epoch + 1,
                        "loss": loss.item(),
                        "lr": self.scheduler.get_last_lr()[0],
                    }
                    self.run_file.append("step", row)
                    self.run_file.flush()  # live readers see steps, not only epochs
                    self.tracker.log(
                        {"train/step_loss": row["loss"], "lr": row["lr"]}, step=self.step
                    )
                self.progress.step(f"loss {loss.item():.4f}")
        return _means(sum_across(self.world, totals))

    @torch.no_grad()
    def evaluate(self, dataset: Any) -> dict[str, float]:
        self.net.eval()
        totals: dict[str, float] = {}
        for inputs, targets in self._loader(dataset, train=False):
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            scores = _score(self.task, self._forward(inputs), targets)
            for key, value in scores.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        return _means(totals)

    def fit(self) -> dict[str, float]:
        """Train the remaining epochs, then test the best weights once; return the summary."""
        s = self.settings
        where = f"device {self.device}"
        if self.device.type == "cpu":
            where += f" ({torch.get_num_threads()} threads"
            backends = attention_backends(self.model, self.device)
            if backends:
                where += f", attention backend {backends}"
            where += ")"
        self.progress.message(
            f"model: {type(self.model).__name__}, {count_parameters(self.model):,} parameters, "
            f"{where}, {len(self.data.train)} train / {len(self.data.val)} val / "
            f"{len(self.data.test)} test"
        )
        while self.epoch < s.epochs:
            epoch = self.epoch
            start = time.perf_counter()
            train_scores = self._train_epoch(epoch)
            with record_function("train.validation"):
                val_scores = self.evaluate(self.data.val)
            elapsed = time.perf_counter() - start
            self.train_time += elapsed
            self.epoch = epoch + 1
            row = {"epoch": self.epoch, "step": self.step, "time_s": elapsed}
            row["lr"] = self.scheduler.get_last_lr()[0]
            row.update({f"train_{k}": v for k, v in train_scores.items()})
            row.update({f"val_{k}": v for k, v in val_scores.items()})
            selection = val_scores.get("exact", val_scores["acc"])
            if selection > self.best_metric:
                self.best_metric = selection
                self.best_epoch = self.epoch
                self.best_state = copy.deepcopy(
                    {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
                )
                self.best_scores = dict(val_scores)
                self.run_file.write_weights(_numpy_state(self.best_state))
            with record_function("train.logging"):
                self.run_file.append("epoch", row)
                self.run_file.write_state(self.state())
                self.run_file.flush()
                self.tracker.log(_tracker_keys(row), step=self.step)
                self.progress.end_epoch(self.epoch, s.epochs, row)
            if self.on_epoch is not None:
                with record_function("train.plotting"):
                    self.on_epoch()
        return self.finish()

    def finish(self) -> dict[str, float]:
        if self.best_state is not None:
            self.model.load_state_dict(self.best_state)
        summary: dict[str, float] = {
            "best_epoch": self.best_epoch,
            "parameters": count_parameters(self.model),
            "train_time_s": self.train_time,
        }
        summary.update({f"best_val_{k}": v for k, v in self.best_scores.items()})
        splits = {"test": self.data.test, **self.data.extra_tests}
        for split, dataset in splits.items():
            for key, value in self.evaluate(dataset).items():
                summary[f"{split}_{key}"] = value
        return summary


def _means(totals: Mapping[str, float]) -> dict[str, float]:
    means = {
        "loss": totals.get("loss", 0.0) / max(1.0, totals.get("count", 0.0)),
        "acc": totals.get("correct", 0.0) / max(1.0, totals.get("count", 0.0)),
    }
    if "exact" in totals:
        means["exact"] = totals["exact"] / max(1.0, totals["sequences"])
    return means


def _tracker_keys(row: Mapping[str, float]) -> dict[str, float]:
    """``train_loss`` -> ``train/loss`` so W&B groups panels by split; others unchanged."""
    out = {}
    for key, value in row.items():
        split, _, name = key.partition("_")
        out[f"{split}/{name}" if split in ("train", "val") else key] = value
    return out


def _numpy_state(state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in state.items()}
