"""Settings of the trainer: plain values, no torch (also the Hydra schema of ``trainer/``)."""

from __future__ import annotations

from dataclasses import dataclass

from symattn_cli.errors import ConfigError

OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULES = ("constant", "cosine")
PROGRESS_MODES = ("auto", "rich", "plain", "none")


@dataclass
class TrainSettings:
    epochs: int = 10
    batch_size: int = 64
    eval_batch_size: int = 256
    optimizer: str = "adam"  # adam | adamw | sgd
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd only
    schedule: str = "constant"  # constant | cosine (linear warm-up, then cosine decay)
    warmup_epochs: float = 0.0
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    grad_clip: float = 0.0  # max global grad norm; 0 disables clipping
    amp: bool = False  # mixed precision; honoured on CUDA only
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = 0  # CPU budget (GSA-Nets: attention threads, 1 intra-op); 0 = torch's default
    num_workers: int = 0
    max_steps_per_epoch: int = 0  # 0 = whole epoch; >0 truncates epochs (smoke tests)
    log_every_steps: int = 20  # per-step metrics every this many optimiser steps
    deterministic: bool = True
    progress: str = "auto"  # auto | rich | plain | none
    profile: bool = False  # profile the run: wall time per part of the step, profile.md
    compile: bool = False  # torch.compile the model (its attention kernels are registered ops)

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the bad value and the fix."""
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"trainer.optimizer={self.optimizer!r} is unknown; use one of {OPTIMIZERS}"
            )
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"trainer.schedule={self.schedule!r} is unknown; use one of {SCHEDULES}"
            )
        if self.progress not in PROGRESS_MODES:
            raise ConfigError(
                f"trainer.progress={self.progress!r} is unknown; use one of {PROGRESS_MODES}"
            )
        for name in ("epochs", "batch_size", "eval_batch_size", "log_every_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"trainer.{name}={getattr(self, name)} must be at least 1")
        if self.lr <= 0:
            raise ConfigError(f"trainer.lr={self.lr} must be positive")
        for name, meaning in (
            ("threads", "0 uses every core"),
            ("num_workers", "0 loads data in the training process"),
            ("max_steps_per_epoch", "0 runs whole epochs"),
            ("warmup_epochs", "0 starts at the full lr"),
            ("weight_decay", "0 turns it off"),
            ("momentum", "0 turns it off"),
            ("grad_clip", "0 disables it"),
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"trainer.{name}={getattr(self, name)} must be >= 0 ({meaning})")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(
                f"trainer.min_lr_ratio={self.min_lr_ratio} is the cosine floor as a fraction of "
                "trainer.lr; give a value from 0 to 1"
            )
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(
                f"trainer.device={self.device!r} is unknown; use auto, cpu, cuda or cuda:N"
            )
