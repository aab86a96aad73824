"""Typed (structured) configs of the runner: trainer, logger and the three commands.

These dataclasses are the schemas Hydra checks overrides against, so ``trainer.epochs=ten``
fails with a one-line error. They are plain data: the builders in ``models``, ``data`` and
``train`` take keyword arguments, and the commands translate config into those arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class TrainerConfig:
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
    amp: bool = False  # mixed precision, used on CUDA only
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = 0  # torch CPU threads; 0 keeps torch's default
    num_workers: int = 0
    max_steps_per_epoch: int = 0  # 0 = whole epoch; >0 truncates (smoke tests)
    log_every_steps: int = 20  # per-step metrics to W&B every this many steps
    checkpoint_every_steps: int = 0  # also save resumable state mid-epoch; 0 = epoch ends only
    deterministic: bool = True
    progress: str = "auto"  # auto | rich | plain | none


@dataclass
class LoggerConfig:
    mode: str = "offline"  # online | offline | disabled
    project: str = "symattn"
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    dir: Optional[str] = None  # where wandb writes; default: the run directory


@dataclass
class TrainConfig:
    model: Any = MISSING
    data: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 0
    resume: Optional[str] = None  # run directory or run file (.h5) to continue
    data_root: str = "data"  # dataset cache; relative paths resolve against the launch dir
    name: str = "train"


@dataclass
class VerifyConfig:
    groups: list[str] = field(default_factory=list)  # empty = all groups
    layers: list[str] = field(default_factory=list)  # empty = all layer kinds
    families: list[str] = field(default_factory=lambda: ["gsa", "knowledge", "attention"])
    dtype: str = "float64"
    offgrid: bool = True
    checkpoint: Optional[str] = None
    seed: int = 0
    image_size: int = 0  # 0 = the built-in default sizes
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    data_root: str = "data"
    plot: bool = True
    name: str = "verify"


@dataclass
class BenchmarkConfig:
    preset: str = "default"
    device: str = "cpu"
    repeats: int = 5
    warmup: int = 2
    threads: int = 0
    fresh_process: bool = True
    groups: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    image_sizes: list[int] = field(default_factory=list)
    patch_sizes: list[int] = field(default_factory=list)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    plot: bool = True
    name: str = "benchmark"


SCHEMAS: list[tuple[Optional[str], str, Any]] = [
    (None, "train_schema", TrainConfig),
    (None, "verify_schema", VerifyConfig),
    (None, "benchmark_schema", BenchmarkConfig),
    ("trainer", "trainer_schema", TrainerConfig),
    ("logger", "logger_schema", LoggerConfig),
]
