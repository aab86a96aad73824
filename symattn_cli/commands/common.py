"""What every command shares: Hydra entry points, run directories, environment, errors."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from symattn_cli.errors import UserError

CONFIG_PATH = "pkg://symattn_cli.conf"
EXIT_USER_ERROR = 2


def fail(message: str) -> None:
    """Print a user-facing error on one line and exit non-zero."""
    print(f"symattn: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USER_ERROR)


def user_errors_exit(task: Callable[..., Any]) -> Callable[..., Any]:
    """Turn :class:`UserError` (and its kin) into one line on stderr and exit status 2.

    An error marked ``end_process`` (a full disk: HDF5 holds a run file it must not write
    again) ends the process at once, without the interpreter's teardown, in which HDF5 would
    try to close that file."""

    @functools.wraps(task)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return task(*args, **kwargs)
        except UserError as err:
            if getattr(err, "end_process", False):
                print(f"symattn: error: {err}", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(EXIT_USER_ERROR)
            fail(str(err))
        except KeyboardInterrupt:
            print("symattn: interrupted; the run file keeps every finished epoch", file=sys.stderr)
            raise SystemExit(130) from None

    return wrapper


def keep_freed_memory() -> None:
    """Let glibc's allocator keep freed memory for the next allocation instead of returning
    it to the system (Linux with glibc; elsewhere nothing changes).

    A training step frees and re-allocates the same tensors of a few hundred kB each. By
    default glibc serves blocks above its mmap threshold by fresh pages and trims the heap's
    top back to the system, so every step pays a page fault per 4 kB again. With the largest
    threshold glibc accepts for mmap (32 MB) and no trimming, the pages stay mapped; the
    process keeps its peak heap, which it reaches again at the next step anyway."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def hydra_entry(config_name: str, task: Callable[[Any], Any]) -> Callable[[], None]:
    """A console entry that registers the schemas and runs ``task`` as a Hydra app, in a
    process whose allocator keeps freed memory (:func:`keep_freed_memory`; also in a
    launcher's worker processes, which run the task and not this entry)."""

    @functools.wraps(task)
    def in_process(*args: Any, **kwargs: Any) -> Any:
        keep_freed_memory()
        return task(*args, **kwargs)

    def main() -> None:
        import hydra

        from symattn_cli.configs import register_configs

        register_configs()
        app = hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=config_name)(
            user_errors_exit(in_process)
        )
        app()

    return main


def run_dir() -> Path:
    """This job's output directory (Hydra's ``runtime.output_dir``)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def resolve_path(path: str) -> Path:
    """A user path relative to where symattn was launched (Hydra does not chdir)."""
    candidate = Path(path).expanduser()
    return candidate if candidate.is_absolute() else Path.cwd() / candidate


def git_commit() -> tuple[str, bool]:
    """``(commit, dirty)`` of the checkout the code runs from, or ``("", False)``."""
    source = Path(__file__).resolve().parents[2]
    for where in (Path.cwd(), source):
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, check=True
            ).stdout.strip()
            status = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=where,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            return commit, bool(status.strip())
        except (OSError, subprocess.CalledProcessError):
            continue
    return "", False


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The host CPU's model and its widest vector instructions (``AMD EPYC, AVX2``), as Linux's
    ``cpuinfo`` names them; the machine name (``x86_64``) where it cannot be read. The C++
    kernel's tile width follows the vector instructions, so its speed differs by them."""
    model, flags = "", set()
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    widest = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"),
                                           ("asimd", "NEON")) if flag in flags), "")  # fmt: skip
    return f"{model}, {widest}" if widest else model


def device_name(device: str = "cpu") -> str:
    """The GPU's name for a CUDA device that is visible, else the CPU's (:func:`cpu_name`)."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return cpu_name()


def environment(device: str = "cpu") -> dict[str, Any]:
    """Versions, device and commit: written into every run file."""
    import h5py
    import numpy
    import torch

    commit, dirty = git_commit()
    return {
        "git_commit": commit,
        "git_dirty": dirty,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "h5py": h5py.__version__,
        "platform": platform.platform(),
        "device": device,
        "device_name": device_name(device),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count() or 0,
        "argv": " ".join(sys.argv),
    }


def start_run_tracker(cfg: Any, directory: Path, *, name: str, job_type: str, **kwargs: Any):
    """The W&B run of a command, configured by its ``logger`` node (mode, project, ...)."""
    from omegaconf import OmegaConf

    from symattn_cli.train.tracking import start_tracker

    logger = cfg.logger
    return start_tracker(
        mode=kwargs.pop("mode", logger.mode),
        project=logger.project,
        entity=logger.entity,
        group=logger.group,
        tags=list(logger.tags),
        wandb_dir=logger.dir,
        run_dir=directory,
        config=OmegaConf.to_container(cfg, resolve=True),
        name=name,
        job_type=job_type,
        **kwargs,
    )


def to_yaml(cfg: Any) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(cfg, resolve=True)
