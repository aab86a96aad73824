"""The C++ chunk loops of the attention core (``gsa_core.cpp``), built on first use.

:mod:`symattn_cli.nn.gsa_core` runs its chunks either as Python loops or, on CPU, through
this extension, which makes the same tensor operations in the same order (tests check that
both give the same values, gradients and dropout masks) without holding the GIL between them:
the attention threads then run side by side instead of queueing on it.

The extension is compiled by torch's extension builder (a C++ compiler and ninja; about 30 s,
once per source, checkout, torch and Python version) into :func:`build_directory`, under torch's
extension cache (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``); later
processes load the cached build. ``SYMATTN_NATIVE=0`` in the environment turns it off. When
it cannot be built, a warning names the reason and the core keeps its Python loops.

Builds are serialised by an advisory lock that the system releases when its holder dies, so
a process killed while compiling does not leave the next one waiting forever (older torch
versions guard their builds with a lock file that outlives a killed holder; while holding
ours, any such file is stale and removed).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).with_name("gsa_core.cpp")
NAME = "symattn_gsa_core"
ENV = "SYMATTN_NATIVE"

_LOCK = threading.Lock()
_STATE: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    """False when ``SYMATTN_NATIVE`` is set to 0 (or off / false / no)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def build_directory() -> Path:
    """Where the extension is built: one folder per torch and Python version (a build is
    only valid for the torch it was compiled against) and per location of the source file.
    torch's builder rebuilds when the source's path changes, so two checkouts sharing one
    folder (a worktree of another commit, to compare the two) would rebuild it in turn."""
    import torch

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    where = hashlib.sha1(str(SOURCE.resolve()).encode()).hexdigest()[:8]
    return Path(root) / f"symattn-{python}-torch{torch.__version__}-{where}" / NAME


def load() -> ModuleType | None:
    """The compiled extension, building it on the first call of the process if needed;
    None when it is turned off or cannot be built (the caller uses its Python loops)."""
    if not enabled():
        return None
    with _LOCK:
        if "module" not in _STATE:
            _STATE["module"] = _build()
        return _STATE["module"]


@contextlib.contextmanager
def _quiet_builder():
    """torch's extension builder logs a warning about CUDA on machines without it."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _build_lock(folder: Path):
    """Exclusive among processes building into ``folder``; released by the system if the
    holder dies. Removes torch's own lock file, which only a dead builder can have left."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "symattn.lock", "w") as handle:
        if os.name == "posix":  # no fcntl elsewhere: torch's own locking only
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
            (folder / "lock").unlink(missing_ok=True)
        yield


def _build() -> ModuleType | None:
    # Loading a cached build takes well under a second; if this takes longer, it compiles.
    notice = threading.Timer(
        2.0,
        lambda: print(
            "symattn: compiling the C++ attention core (once per version, about 30 s) ...",
            file=sys.stderr,
            flush=True,
        ),
    )
    notice.daemon = True
    try:
        folder = build_directory()
        with _quiet_builder(), _build_lock(folder):
            from torch.utils import cpp_extension

            notice.start()
            return cpp_extension.load(
                name=NAME,
                sources=[str(SOURCE)],
                extra_cflags=["-O3"],
                build_directory=str(folder),
                verbose=False,
            )
    except Exception as error:  # a missing compiler or ninja, a failed build
        reason = " ".join(str(error).split())[:300]
        warnings.warn(
            f"symattn: the C++ attention core could not be built ({type(error).__name__}: "
            f"{reason}); the attention runs its Python loops, which give the same values "
            "more slowly. Install a C++ compiler and `pip install ninja` to build it, or set "
            f"{ENV}=0 to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    finally:
        notice.cancel()
