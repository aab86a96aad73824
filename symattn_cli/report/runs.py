"""Find the run files behind the paths a user gives, and read each into a :class:`Run`.

A path is a run directory, a ``run.h5``, a sweep directory (every ``run.h5`` below it), or a
glob of these. A run still training is read through SWMR, as far as it has got; any other
file is first checked whole (its length and every checksum), and a damaged one becomes a
``damaged`` run that is listed, never averaged. A run's config is flattened to dotted keys
(``model.group``); the option picked in each config group (``model: r4_mini``) comes from the
run file or, for files written before it stored them, from the Hydra record next to it
(``.hydra/hydra.yaml``).
"""

from __future__ import annotations

import dataclasses
import glob
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from symattn_cli.errors import UserError

RUN_FILE = "run.h5"
HYDRA_RECORD = Path(".hydra") / "hydra.yaml"
FINISHED = "finished"
# "stopped": the file says running, but the process writing it is gone (killed).
# "damaged": cut short or failing a checksum (see symattn_cli.train.runfile).
STATUSES = ("finished", "running", "stopped", "diverged", "failed", "damaged", "unreadable")
GLOB_CHARS = re.compile(r"[*?\[]")
PATHS_HINT = (
    "pass run directories, run.h5 files or sweep directories (globs allowed), e.g. "
    "`symattn report multirun/train/2026-11-22/10-00-00`"
)


@dataclasses.dataclass
class Run:
    """One run file, read. ``config`` is flat (``{"model.group": "z4", ...}``), ``choices``
    maps config groups to options (``{"model": "r4_mini"}``); ``epochs`` holds the per-epoch
    metrics written so far; ``error`` says why an ``unreadable`` or ``damaged`` file could not
    be read; ``note`` is set for files of a format without checksums."""

    path: Path
    status: str
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    choices: dict[str, str] = dataclasses.field(default_factory=dict)
    summary: dict[str, float] = dataclasses.field(default_factory=dict)
    epochs: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    commit: str = ""
    dirty: bool = False
    error: str = ""
    note: str = ""

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    @property
    def epochs_done(self) -> int:
        return len(self.epochs.get("epoch", ()))


def natural_key(path: Path | str) -> list[Any]:
    """Sort key that puts ``sweep/9`` before ``sweep/10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def find_run_files(paths: Sequence[str], cwd: Path) -> tuple[list[Path], list[Path]]:
    """``(run files, skipped)``: the ``run.h5`` files behind ``paths``, in the order given
    (directories and globs in natural order), each once; ``skipped`` are the run files of
    other commands (benchmark) found inside directories.

    Raises :class:`UserError` naming the path when one does not exist, matches nothing, holds
    no run file, or is a file that is not a training run file."""
    from symattn_cli.train.runfile import DamagedRunFileError, check_run_file, read_command

    found: list[Path] = []
    skipped: list[Path] = []
    for given in paths:
        target = Path(given).expanduser()
        target = target if target.is_absolute() else cwd / target
        if GLOB_CHARS.search(given):
            matches = [Path(m) for m in sorted(glob.glob(str(target), recursive=True),
                                               key=natural_key)]  # fmt: skip
            if not matches:
                raise UserError(f"paths: {given!r} matches nothing; {PATHS_HINT}")
        elif target.exists():
            matches = [target]
        else:
            raise UserError(f"paths: {given!r} does not exist; {PATHS_HINT}")
        files: list[Path] = []
        for match in matches:
            if match.is_dir():
                inside = sorted(match.rglob(RUN_FILE), key=natural_key)
                for path in inside:
                    if _command(path) in ("train", None):  # None: unreadable, listed later
                        files.append(path)
                    else:
                        skipped.append(path)
            else:
                try:
                    check_run_file(match)  # an explicitly named file must be a run file
                except DamagedRunFileError:
                    files.append(match)  # listed as damaged, like one found in a directory
                    continue
                command = read_command(match)
                if command != "train":
                    raise UserError(
                        f"paths: {given!r} was written by `symattn {command}`, not `symattn "
                        "train`; a report compares training runs"
                    )
                files.append(match)
        if not files:
            raise UserError(
                f"paths: {given!r} holds no run file of `symattn train` (no {RUN_FILE} below "
                f"it); {PATHS_HINT}"
            )
        found += files
    unique = list(dict.fromkeys(p.resolve() for p in found))
    return unique, skipped


def _command(path: Path) -> str | None:
    from symattn_cli.train.runfile import read_command

    try:
        return read_command(path)
    except (OSError, RuntimeError, KeyError, UserError):  # damaged or not HDF5: listed later
        return None


def read_run(path: Path) -> Run:
    """Read a run file; a file that cannot be read becomes an ``unreadable`` run."""
    from symattn_cli.train import runfile

    try:
        note = runfile.check_run_file(path)
        status = runfile.read_status(path)
        if status == "running" and not runfile.writer_alive(path):
            status = "stopped"
        env = runfile.read_env(path)
        return Run(
            path=path,
            status=status,
            config=flatten(_yaml(runfile.read_config_yaml(path))),
            choices=read_choices(path),
            summary=runfile.read_summary(path),
            epochs=runfile.read_metrics(path, "epoch"),
            commit=str(env.get("git_commit", "")),
            dirty=bool(env.get("git_dirty", False)),
            note=note,
        )
    except runfile.DamagedRunFileError as err:
        return Run(path=path, status="damaged", error=str(err).splitlines()[0])
    except (OSError, RuntimeError, KeyError, ValueError, UserError) as err:
        return Run(path=path, status="unreadable", error=str(err).splitlines()[0])


def read_choices(path: Path) -> dict[str, str]:
    """Config-group options of a run: from its file, else from ``.hydra/hydra.yaml`` beside it
    (Hydra's own groups, ``hydra/...``, left out); ``{}`` when neither has them."""
    from symattn_cli.train.runfile import read_choices_yaml

    stored = read_choices_yaml(path)
    if stored:
        choices = _yaml(stored) or {}
    else:
        record = Path(path).parent / HYDRA_RECORD
        if not record.is_file():
            return {}
        hydra = (_yaml(record.read_text()) or {}).get("hydra", {})
        choices = hydra.get("runtime", {}).get("choices", {}) or {}
    return {str(k): str(v) for k, v in choices.items() if not str(k).startswith("hydra/")}


def _yaml(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def flatten(tree: Mapping[str, Any] | None, prefix: str = "") -> dict[str, Any]:
    """``{"model": {"group": "z4"}}`` -> ``{"model.group": "z4"}``; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in (tree or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def format_value(value: Any) -> str:
    """A config value as a table cell: ``true``, ``0.01``, ``[16, 20, 28]``, ``null``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)


def read_runs(files: Iterable[Path]) -> list[Run]:
    return [read_run(path) for path in files]
