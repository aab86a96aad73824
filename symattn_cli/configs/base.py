"""Typed (structured) configs of the runner: trainer, logger and the commands.

These dataclasses are the schemas Hydra checks overrides against, so ``trainer.epochs=ten``
fails with a one-line error. They are plain data: the builders in ``models``, ``data`` and
``train`` take keyword arguments, and the commands translate config into those arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from symattn_cli.train.settings import TrainSettings

# The trainer's own settings dataclass is the schema: one definition, no copy to drift.
TrainerConfig = TrainSettings


@dataclass
class LoggerConfig:
    mode: str = "offline"  # online | offline | disabled
    project: str = "symattn"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    dir: str | None = None  # where wandb writes; default: the run directory


@dataclass
class TrainConfig:
    model: Any = MISSING
    data: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 0
    resume: str | None = None  # run directory or run file (.h5) to continue
    data_root: str = "data"  # dataset cache; relative paths resolve against the launch dir
    name: str = "train"


@dataclass
class VerifyConfig:
    """``symattn verify-equivariance``: the built-in suite, ``checkpoint=`` a trained model, or
    ``model=<name>`` any model config's whole model under each element of ``groups``, with
    ``claims`` the groups it must be exactly invariant (or equivariant) to."""

    model: Any = None  # a model config (model=<name>): check that model
    data: Any = None  # the data config its facts come from (data=<name>)
    trainer: Any = None  # set by the configs of sequence models; unused here
    claims: list[str] = field(default_factory=list)  # model=: groups it must respect exactly
    data_root: str = "data"
    groups: list[str] = field(default_factory=list)  # empty = all groups
    layers: list[str] = field(default_factory=list)  # empty = all layer kinds
    families: list[str] = field(default_factory=lambda: ["gsa", "knowledge", "attention"])
    dtype: str = "float64"
    offgrid: bool = True
    checkpoint: str | None = None
    checkpoint_images: int = 500  # test digits the checkpoint checks rotate
    seed: int = 0
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    plot: bool = True
    full_table: bool = False  # one table line per element instead of the worst per layer
    name: str = "verify"


@dataclass
class BenchmarkConfig:
    """``symattn benchmark``: a preset's cases, narrowed or re-sized by the axis lists.

    Empty lists and ``null`` mean "the preset's". ``groups``/``models``/``layers`` filter the
    preset's cases; ``batch_sizes``/``image_sizes``/``patch_sizes`` set every case to each
    value given (``patch_sizes``: odd sides P, or ``global`` for global attention), and
    ``attention_backends`` measures every case with attention once per backend named
    (``[triton,torch]``: the Triton kernel against the plain PyTorch core on the same GPU).
    """

    # default | matched | sweep | reference | index | global | gpu | gpu-static | quick
    preset: str = "default"
    device: str = "cpu"  # cpu | cuda | cuda:<index>
    repeats: int | None = None  # timed steps per mode (median and spread over these)
    warmup: int | None = None  # untimed steps first
    threads: int | None = None  # CPU threads; 0 = PyTorch's default
    fresh_process: bool | None = None  # one fresh Python process per case
    modes: list[str] = field(default_factory=list)  # train (forward+backward) | forward
    groups: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)  # gsa | conv | gconv
    batch_sizes: list[int] = field(default_factory=list)
    image_sizes: list[int] = field(default_factory=list)
    patch_sizes: list[Any] = field(default_factory=list)  # odd sides P, or global
    # GSA layers and nets once per attention backend: auto | cpp | triton | triton_tiles | torch
    attention_backends: list[str] = field(default_factory=list)
    count_flops: bool = True
    arch: int = 90  # preset=gpu-static: the compute capability compiled for (90: H100, 80: A100)
    # preset=gpu-static: print and keep the N source lines of each kernel with the most
    # instructions (0: none), and compile with at most this many registers a thread (0: the
    # compiler's choice; what does not fit spills)
    lines: int = 0
    max_registers: int = 0
    omp_wait_policy: str = ""  # OpenMP idle threads: "" (the library's default) | passive | active
    # a checkout of github.com/dwromero/g_selfatt: its rotMNIST nets measured beside ours
    # ("": the ratios use the published figures)
    reference_code: str = ""
    # the C++ kernel to time ours against, alternated in one process: a git revision of this
    # checkout (HEAD~1) or a cpp_kernel.cpp path ("": off); with preset=gpu-static the Triton
    # kernels of that revision, each reported beside today's
    kernel_baseline: str = ""
    case_timeout: float = 600.0  # seconds per case (fresh processes only)
    compile: bool = False  # torch.compile every case (its first steps, compiling: compile_s)
    seed: int = 0
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    plot: bool = True
    name: str = "benchmark"


@dataclass
class ReportConfig:
    """``symattn report PATH...``: compare the runs behind ``paths``.

    Empty lists mean "automatic": ``group_by`` the config values that differ between the runs
    (a config group by its option, ``model``; else dotted keys, ``data.variant``), ``metrics``
    every test score, ``curves`` the validation score and the training loss.
    """

    paths: list[str] = field(default_factory=list)  # run dirs, run.h5 files, sweep dirs; globs
    metrics: list[str] = field(default_factory=list)  # summary metrics (test_acc, best_val_acc)
    group_by: list[str] = field(default_factory=list)  # config groups or keys; [] = what differs
    ignore: list[str] = field(  # never columns of the automatic grouping (seed: runs collapse)
        default_factory=lambda: ["seed", "logger", "trainer.progress",
                                 "trainer.log_every_steps", "resume", "data_root", "name"]
    )  # fmt: skip
    sort_by: str = ""  # a metric: best group first; "" = order of first appearance
    curves: list[str] = field(default_factory=list)  # epoch metrics (val_acc, train_loss)
    x: str = ""  # a numeric column: each metric against it (trend.png), a line per other label
    scatter: list[str] = field(default_factory=list)  # [x, y] metrics: y against x (scatter.png)
    title: str = ""
    plot: bool = True
    name: str = "report"


SCHEMAS: list[tuple[str | None, str, Any]] = [
    (None, "train_schema", TrainConfig),
    (None, "report_schema", ReportConfig),
    (None, "verify_schema", VerifyConfig),
    (None, "benchmark_schema", BenchmarkConfig),
    (None, "trainer_schema", TrainerConfig),
    (None, "logger_schema", LoggerConfig),
]
