"""A file of this checkout as it was at a git revision: what ``kernel_baseline=`` compares with."""

from __future__ import annotations

import subprocess
from pathlib import Path


def file_at(path: Path, revision: str) -> bytes:
    """The contents of ``path`` (a file of this checkout) at git ``revision``; raises
    ``ValueError`` with git's last line of error where there is no such file, revision or git."""
    command = ["git", "-C", str(path.parent), "show", f"{revision}:./{path.name}"]
    try:
        done = subprocess.run(command, capture_output=True, timeout=60)
    except OSError as err:  # no git
        raise ValueError(str(err) or "git failed") from None
    if done.returncode:
        error = done.stderr.decode(errors="replace").strip() or f"git exited {done.returncode}"
        raise ValueError(error.splitlines()[-1])
    return done.stdout


def copy_at(path: Path, revision: str, directory: str | Path) -> Path:
    """``path`` as it was at git ``revision``, written into ``directory`` as
    ``baseline_<name>``; raises ``ValueError`` as :func:`file_at` does."""
    copy = Path(directory) / f"baseline_{path.name}"
    copy.write_bytes(file_at(path, revision))
    return copy
