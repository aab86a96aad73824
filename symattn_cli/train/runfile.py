"""The HDF5 run file: one per run, readable while the run writes it.

Schema (``format = "symattn-run"``, ``format_version = 2``; documented in docs/runfile.md):

    /                        attrs: format, format_version, command, created, symattn_version
    /config                  attrs: yaml (the resolved config), choices (YAML: the option
                                    chosen in each config group, e.g. model: r4_mini)
    /env                     attrs: git_commit, git_dirty, python, torch, h5py, numpy, platform,
                                    device, device_name, threads
    /metrics/epoch/<name>    float64 (E,) resizable, one row per finished epoch
    /metrics/step/<name>     float64 (S,) resizable, one row per logged optimiser step
    /status                  utf-8 string: running | finished | diverged | failed
    /writer                  utf-8 string: "host:pid" of the process writing the file
    /summary/<name>          float64 scalar: final metrics (NaN until the run has finished)
    /weights/best/<param>    the best-on-validation weights, one dataset per state_dict entry
    /state/blob0, blob1      uint8: model, optimiser, scheduler, RNG states, epoch, step,
                             best tracking, logger run id, in the pickle-free format of
                             :mod:`symattn_cli.train.state_codec` (reading runs no code)
    /state/size0, size1      int64 scalars: the valid length of each blob
    /state/current           int64 scalar: the slot holding the latest complete state (-1: none)
    /results/...             command-specific tables (equivariance, benchmarks)

Every dataset is created before SWMR mode is switched on, so a second process can open the
file with ``h5py.File(path, "r", libver="latest", swmr=True)`` and read live metrics; the
writer flushes after every epoch, so a killed run keeps every finished epoch and its state.
The state is written into the slot not in use and only then made current, so a kill during
that write leaves the previous state intact. (One byte blob per slot, not a dataset per
tensor: no dataset can be created once the file is in SWMR mode.)

Format 1 stored the state as the bytes of ``torch.save``, a pickle; resuming such a file is
refused with a one-line error rather than unpickled, since unpickling runs code. Everything
else in a format 1 file (config, metrics, best weights, results) reads as before.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from symattn_cli.errors import UserError

FORMAT = "symattn-run"
FORMAT_VERSION = 2
# The first bytes of a torch.save file (a zip archive holding a pickle): format 1's state.
TORCH_SAVE_MAGIC = b"PK\x03\x04"
STATUS_LENGTH = 16


class RunFileError(UserError):
    """A file given as a run file is missing, corrupt or not a symattn run file."""


def _string_dtype():
    return h5py.string_dtype("utf-8")


class RunFile:
    """Writer of one run's HDF5 file (see the module docstring for the schema)."""

    def __init__(self, handle: h5py.File, path: Path) -> None:
        self._h5 = handle
        self.path = path

    # -- creation and reopening -------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: Path,
        *,
        command: str,
        config_yaml: str,
        env: Mapping[str, Any],
        epoch_metrics: Iterable[str],
        step_metrics: Iterable[str],
        summary_metrics: Iterable[str],
        weights: Mapping[str, np.ndarray] | None = None,
        extra: Mapping[str, Any] | None = None,
        choices: str = "",
    ) -> RunFile:
        """Create the file with every dataset it will ever need, then enter SWMR mode.

        ``choices``: YAML of the option picked in each config group (``model: r4_mini``), so
        that a report can name a run's model as the command line did."""
        import datetime

        from symattn_cli.version import __version__

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            raise RunFileError(
                f"{path} already exists; a run file is never overwritten. Choose another "
                "hydra.run.dir, or continue that run with resume="
            )
        h5 = h5py.File(path, "w-", libver="latest")
        h5.attrs["format"] = FORMAT
        h5.attrs["format_version"] = FORMAT_VERSION
        h5.attrs["command"] = command
        h5.attrs["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
        h5.attrs["symattn_version"] = __version__
        config = h5.create_group("config")
        config.attrs["yaml"] = config_yaml
        if choices:
            config.attrs["choices"] = choices
        env_group = h5.create_group("env")
        for key, value in env.items():
            env_group.attrs[key] = value if isinstance(value, (bool, int, float)) else str(value)
        for kind, names in (("epoch", epoch_metrics), ("step", step_metrics)):
            group = h5.create_group(f"metrics/{kind}")
            for name in names:
                group.create_dataset(name, shape=(0,), maxshape=(None,), dtype="f8", chunks=(256,))
        summary = h5.create_group("summary")
        for name in summary_metrics:
            summary.create_dataset(name, data=np.nan, dtype="f8")
        h5.create_dataset("status", data="running", dtype=_string_dtype())
        h5.create_dataset("writer", data=_writer_id(), dtype=_string_dtype())
        best = h5.create_group("weights/best")
        for name, array in (weights or {}).items():
            best.create_dataset(name, data=np.zeros_like(array))
        state = h5.create_group("state")
        for slot in (0, 1):
            state.create_dataset(
                f"blob{slot}", shape=(0,), maxshape=(None,), dtype="u1", chunks=(1 << 20,)
            )
            state.create_dataset(f"size{slot}", data=0, dtype="i8")
        state.create_dataset("current", data=-1, dtype="i8")
        if extra:
            _write_tree(h5.require_group("results"), extra)
        h5.flush()
        h5.swmr_mode = True
        return cls(h5, path)

    @classmethod
    def reopen(cls, path: Path) -> RunFile:
        """Open an existing run file for appending (resume)."""
        check_run_file(path)
        try:
            h5 = h5py.File(path, "r+", libver="latest")
        except OSError as err:
            if "already open for write" not in str(err):
                raise RunFileError(f"{path} cannot be opened for writing: {err}") from None
            # A writer that died (SIGKILL, power loss) leaves the SWMR-write flag set, and
            # HDF5 then refuses to open the file for writing. Only when that writer is gone
            # (two live writers would corrupt the file), rewrite its content into a fresh
            # file and swap it in atomically: nothing already written is lost.
            writer = _read_string(path, "writer")
            if _writer_alive(writer):
                raise RunFileError(
                    f"{path} is still being written by process {writer}; wait for it to end "
                    "or stop it before resuming"
                ) from None
            _rewrite(Path(path))
            h5 = h5py.File(path, "r+", libver="latest")
        h5["writer"][()] = _writer_id()
        h5.swmr_mode = True
        return cls(h5, Path(path))

    def close(self) -> None:
        if self._h5.id.valid:
            self._h5.flush()
            self._h5.close()

    def __enter__(self) -> RunFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing --------------------------------------------------------------------------------

    def append(self, kind: str, row: Mapping[str, float]) -> None:
        """Append one row to ``/metrics/<kind>``; names the file does not know are ignored."""
        group = self._h5[f"metrics/{kind}"]
        length = self.num_rows(kind)
        for name, dataset in group.items():
            dataset.resize((length + 1,))
            value = row.get(name, math.nan)
            dataset[length] = float(value)

    def metrics(self, kind: str) -> dict[str, np.ndarray]:
        """The rows of ``/metrics/<kind>`` written so far (read through the writer's handle)."""
        rows = self.num_rows(kind)
        return {name: d[:rows] for name, d in self._h5[f"metrics/{kind}"].items()}

    def num_rows(self, kind: str) -> int:
        group = self._h5[f"metrics/{kind}"]
        return min((d.shape[0] for d in group.values()), default=0)

    def rows_until(self, kind: str, column: str, limit: float) -> int:
        """How many leading rows of ``/metrics/<kind>`` have ``column <= limit``."""
        values = self._h5[f"metrics/{kind}/{column}"][: self.num_rows(kind)]
        return int(np.searchsorted(values, limit, side="right"))

    def truncate(self, kind: str, rows: int) -> None:
        """Drop rows past ``rows`` (metrics written after the state a resume restarts from)."""
        for dataset in self._h5[f"metrics/{kind}"].values():
            if dataset.shape[0] > rows:
                dataset.resize((rows,))

    def set_status(self, status: str) -> None:
        self._h5["status"][()] = status

    def set_summary(self, values: Mapping[str, float]) -> None:
        summary = self._h5["summary"]
        for name, value in values.items():
            if name in summary:
                summary[name][()] = float(value)

    def write_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        best = self._h5["weights/best"]
        for name, array in weights.items():
            best[name][...] = array

    def write_state(self, state: Mapping[str, Any]) -> None:
        """Store the resumable training state (:func:`symattn_cli.train.state_codec.encode`)."""
        from symattn_cli.train.state_codec import encode

        payload = np.frombuffer(encode(state), dtype=np.uint8)
        slot = 1 - max(0, int(self._h5["state/current"][()]))
        blob = self._h5[f"state/blob{slot}"]
        if blob.shape[0] < payload.shape[0]:
            blob.resize((payload.shape[0],))
        blob[: payload.shape[0]] = payload
        self._h5[f"state/size{slot}"][()] = payload.shape[0]
        self._h5.flush()
        self._h5["state/current"][()] = slot

    def flush(self) -> None:
        self._h5.flush()


class NullRunFile:
    """Stands in for the run file on processes that must not write (torchrun ranks > 0)."""

    path = Path("/dev/null")

    def __getattr__(self, name: str):
        if name in ("append", "flush", "write_weights", "write_state", "truncate",
                    "set_status", "set_summary", "close"):  # fmt: skip
            return lambda *args, **kwargs: None
        if name == "rows_until":
            return lambda *args, **kwargs: 0
        raise AttributeError(name)


def write_results_file(
    path: Path,
    *,
    command: str,
    config_yaml: str,
    env: Mapping[str, Any],
    tables: Mapping[str, list[Mapping[str, Any]]],
    summary: Mapping[str, float] | None = None,
) -> Path:
    """Write the run file of a command that produces tables (verify, benchmark).

    Each table is stored under ``/results/<table>/<column>``: one dataset per column (numbers
    as float64, text as utf-8 strings), rows in the order given.
    """
    results = {name: _columns(rows) for name, rows in tables.items()}
    handle = RunFile.create(
        path,
        command=command,
        config_yaml=config_yaml,
        env=env,
        epoch_metrics=(),
        step_metrics=(),
        summary_metrics=tuple(summary or ()),
        extra=results,
    )
    with handle:
        handle.set_summary(summary or {})
        handle.set_status("finished")
    return Path(path)


def _columns(rows: list[Mapping[str, Any]]) -> dict[str, Any]:
    names: list[str] = []
    for row in rows:
        names += [key for key in row if key not in names]
    columns: dict[str, Any] = {}
    for name in names:
        values = [row.get(name) for row in rows]
        if all(isinstance(v, (int, float, bool, np.number)) or v is None for v in values):
            columns[name] = np.array([np.nan if v is None else float(v) for v in values])
        else:
            columns[name] = np.array(["" if v is None else str(v) for v in values], dtype=object)
    return columns


def read_table(path: Path, table: str) -> dict[str, np.ndarray]:
    """A results table of a run file as ``{column: values}`` (text decoded to ``str``)."""
    with h5py.File(path, "r", libver="latest", swmr=True) as h5:
        group = h5[f"results/{table}"]
        out = {}
        for name, dataset in group.items():
            values = dataset[...]
            if values.dtype.kind == "O":
                values = np.array([v.decode() if isinstance(v, bytes) else v for v in values])
            out[name] = values
        return out


def _rewrite(path: Path) -> None:
    """Copy a run file left open by a dead writer into a clean file at the same path."""
    fresh = path.with_name(path.name + ".rewrite")
    with h5py.File(path, "r", libver="latest", swmr=True) as old:
        with h5py.File(fresh, "w", libver="latest") as new:
            for key, value in old.attrs.items():
                new.attrs[key] = value
            for name in old:
                old.copy(old[name], new, name=name)
    os.replace(fresh, path)


def _writer_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _writer_alive(writer: str) -> bool:
    host, _, pid = writer.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another machine: cannot tell; the SWMR flag is all we have
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_string(path: Path, name: str) -> str:
    with h5py.File(path, "r", libver="latest", swmr=True) as h5:
        value = h5[name][()]
    return value.decode() if isinstance(value, bytes) else str(value)


def _write_tree(group: h5py.Group, tree: Mapping[str, Any]) -> None:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            _write_tree(group.require_group(key), value)
        elif isinstance(value, str):
            group.create_dataset(key, data=value, dtype=_string_dtype())
        elif isinstance(value, np.ndarray) and value.dtype.kind == "O":
            group.create_dataset(key, data=value, dtype=_string_dtype())
        else:
            group.create_dataset(key, data=np.asarray(value))


# -- reading ----------------------------------------------------------------------------------


def check_run_file(path: Path) -> None:
    """Raise :class:`RunFileError` unless ``path`` is a readable symattn run file."""
    path = Path(path)
    if not path.is_file():
        raise RunFileError(f"run file {path} does not exist; pass a run directory or its run.h5")
    try:
        with h5py.File(path, "r", libver="latest", swmr=True) as h5:
            fmt = h5.attrs.get("format")
            if fmt != FORMAT:
                raise RunFileError(
                    f"{path} is an HDF5 file but not a symattn run file (format={fmt!r}); "
                    "pass the run.h5 written by `symattn train`"
                )
    except (OSError, RuntimeError, KeyError) as err:  # what h5py raises for damaged files
        raise RunFileError(
            f"{path} cannot be read as HDF5 ({err}); it is corrupt or not a run file. "
            "Pass the run.h5 written by `symattn train`, or start a new run without resume="
        ) from None


def read_metrics(path: Path, kind: str = "epoch") -> dict[str, np.ndarray]:
    """The metrics table of a run file, safe to call while the run is writing it."""
    with h5py.File(path, "r", libver="latest", swmr=True) as h5:
        group = h5[f"metrics/{kind}"]
        columns = {}
        for name, dataset in group.items():
            dataset.refresh()
            columns[name] = dataset[...]
        rows = min((len(c) for c in columns.values()), default=0)
        return {name: column[:rows] for name, column in columns.items()}


def read_summary(path: Path) -> dict[str, float]:
    with h5py.File(path, "r", libver="latest", swmr=True) as h5:
        return {name: float(d[()]) for name, d in h5["summary"].items()}


def read_status(path: Path) -> str:
    return _read_string(path, "status")


def read_config_yaml(path: Path) -> str:
    with h5py.File(path, "r", libver="latest", swmr=True) as h5:
        return str(h5["config"].attrs["yaml"])


def read_choices_yaml(path: Path) -> str:
    """The config-group options the run was composed from (YAML), or ``""`` if not stored."""
    with h5py.File(path, "r", libver="latest", swmr=True) as h5:
        return str(h5["config"].attrs.get("choices", ""))


def read_env(path: Path) -> dict[str, Any]:
    """The ``/env`` attributes: commit, versions, device, threads."""
    with h5py.File(path, "r", libver="latest", swmr=True) as h5:
        return {key: _plain(value) for key, value in h5["env"].attrs.items()}


def read_command(path: Path) -> str:
    """The command that wrote the file (``train``, ``benchmark``, ...)."""
    with h5py.File(path, "r", libver="latest", swmr=True) as h5:
        return str(h5.attrs.get("command", ""))


def writer_alive(path: Path) -> bool:
    """Whether the process named in ``/writer`` still runs (True when it cannot be told: a
    writer on another machine)."""
    writer = _read_string(path, "writer")
    host, _, _ = writer.rpartition(":")
    if host != socket.gethostname():
        return True
    return _writer_alive(writer)


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    return value.item() if isinstance(value, np.generic) else value


def read_weights(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r", libver="latest", swmr=True) as h5:
        return {name: d[...] for name, d in h5["weights/best"].items()}


def read_state(path: Path) -> dict[str, Any] | None:
    """The resumable state stored in a run file, or ``None`` if none was written yet.

    Decoding runs no code whatever the file holds: anything but a state in
    :mod:`symattn_cli.train.state_codec`'s format (a format 1 pickle, damaged or crafted
    bytes) raises :class:`RunFileError`, and the file is left as it is.
    """
    from symattn_cli.train.state_codec import StateFormatError, decode

    try:
        with h5py.File(path, "r", libver="latest", swmr=True) as h5:
            slot = int(h5["state/current"][()])
            if slot < 0:
                return None
            size = int(h5[f"state/size{slot}"][()])
            payload = h5[f"state/blob{slot}"][:size].tobytes()
    except (OSError, KeyError, ValueError, TypeError) as err:
        raise RunFileError(f"{path}: its training state cannot be read ({err})") from None
    if payload.startswith(TORCH_SAVE_MAGIC):
        raise RunFileError(
            f"{path} keeps its training state as a pickle (run file format 1), which is not "
            "loaded because unpickling a shared file can run code; start the run again "
            "without resume= (its metrics and best weights stay readable)"
        )
    try:
        return decode(payload)
    except StateFormatError as err:
        raise RunFileError(
            f"{path}: the training state is not one symattn wrote ({err}), so it is not "
            "loaded; start the run again without resume="
        ) from None
