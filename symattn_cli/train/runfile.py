"""The HDF5 run file: one per run, readable while the run writes it.

Schema (``format = "symattn-run"``, ``format_version = 3``; documented in docs/runfile.md):

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
    /state/digest0, digest1  uint8 (32,): SHA-256 of each blob's valid bytes
    /state/current           int64 scalar: the slot holding the latest complete state (-1: none)
    /results/...             command-specific tables (equivariance, benchmarks)

Checksums (format 3): every array (metrics, weights, state blobs, result columns) is chunked
with HDF5's Fletcher-32 filter, so a changed byte fails the read of its chunk; every scalar
(summary, status, writer, state sizes and pointer) is stored compact, inside its object
header, which HDF5 checksums like all metadata of a ``libver="latest"`` file; the state also
carries a SHA-256 digest, since Fletcher-32 cannot tell a chunk of zeros (what a read past a
cut end returns) from data. Text is stored fixed-length, as variable-length strings live in
an unchecked heap.

Reading (:func:`check_run_file`, every ``read_*``): a file whose writer is gone is checked as
a whole (HDF5's end-of-file check, which SWMR reading skips) before anything in it is
trusted, and a damaged file raises :class:`DamagedRunFileError` naming what is wrong. Only a
file whose writer still runs on this host is read through SWMR unchecked. A killed writer
leaves its SWMR flag set, which makes HDF5 refuse a plain open; such a file is opened plainly
all the same, through a view of it whose superblock reads as if the writer had closed it
(:class:`_WithoutWriterFlags`; the file is not changed).

Every dataset is created before SWMR mode is switched on, so a second process can open the
file with ``h5py.File(path, "r", libver="latest", swmr=True)`` and read live metrics; the
writer flushes after every epoch, so a killed run keeps every finished epoch and its state.
The state is written into the slot not in use and only then made current, so a kill during
that write leaves the previous state intact. (One byte blob per slot, not a dataset per
tensor: no dataset can be created once the file is in SWMR mode.)

A full disk (or quota) stops the writer with :class:`DiskFullError`: HDF5 is then kept from
writing another byte, and the file is put back as it was after the last complete state (its
superblock restored, its tail cut), so it resumes from that epoch once there is space.

Format 1 stored the state as the bytes of ``torch.save``, a pickle; resuming such a file is
refused with a one-line error rather than unpickled, since unpickling runs code. Everything
else in a format 1 file (config, metrics, best weights, results) reads as before. Files of
format 1 and 2 carry no checksums: they read as before, with a note saying so.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import math
import os
import re
import socket
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from symattn_cli.errors import UserError

FORMAT = "symattn-run"
FORMAT_VERSION = 3
# The first format whose datasets carry checksums.
CHECKSUM_VERSION = 3
# The first bytes of a torch.save file (a zip archive holding a pickle): format 1's state.
TORCH_SAVE_MAGIC = b"PK\x03\x04"
STATUS_LENGTH = 16
WRITER_LENGTH = 256
# What a write fails with when the disk (or the user's quota, or the file size limit) is full.
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class RunFileError(UserError):
    """A file given as a run file is missing, corrupt or not a symattn run file."""


class DamagedRunFileError(RunFileError):
    """A run file that is cut short or fails a checksum: none of it is read as data."""


class DiskFullError(UserError):
    """A write to the run file found no space; the file keeps ``safe_epoch`` and its state.

    ``end_process``: the process should end without closing the file through HDF5."""

    end_process = True

    def __init__(self, message: str, *, path: Path, safe_epoch: int) -> None:
        super().__init__(message)
        self.path = path
        self.safe_epoch = safe_epoch


def _compact(group: h5py.Group, name: str, value: Any, dtype: Any) -> None:
    """A scalar or small array stored inside its object header, under HDF5's metadata
    checksum (a contiguous dataset's bytes are not checked)."""
    dtype = np.dtype(dtype)
    array = np.asarray(value, dtype=dtype)
    space = h5py.h5s.create_simple(array.shape) if array.ndim else h5py.h5s.create(h5py.h5s.SCALAR)
    plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    plist.set_layout(h5py.h5d.COMPACT)
    h5py.h5d.create(group.id, name.encode(), h5py.h5t.py_create(dtype, logical=True), space,
                    dcpl=plist)  # fmt: skip
    group[name][()] = array


def _text(group: h5py.Group, name: str, value: str, length: int) -> None:
    """A fixed-length UTF-8 string (compact, checksummed) of room ``length`` bytes."""
    _compact(group, name, value.encode(), h5py.string_dtype("utf-8", length))


def _checked_array(group: h5py.Group, name: str, data: np.ndarray) -> None:
    """An array with a Fletcher-32 checksum per chunk; 0-d and empty arrays, which cannot be
    chunked, are stored compact."""
    if data.ndim == 0 or data.size == 0:
        _compact(group, name, data, data.dtype)
    else:
        group.create_dataset(name, data=data, chunks=True, fletcher32=True)


class RunFile:
    """Writer of one run's HDF5 file (see the module docstring for the schema).

    ``safe_epoch`` is the epoch of the last state known to be complete on disk (0: none);
    after each such state the file's superblock and length are kept, so that a full disk can
    put the file back to that point (:meth:`_stop_writing`)."""

    def __init__(self, handle: h5py.File, path: Path, *, safe_epoch: int = 0) -> None:
        self._h5 = handle
        self.path = path
        self.safe_epoch = safe_epoch
        self._stopped = False
        # Datasets stay open while the file does: closing one flushes its chunk cache, and
        # a write failing there (a full disk) could not be caught.
        self._open: dict[str, h5py.Dataset] = {}
        self._safe_point: tuple[bytes, int] | None = None
        self._keep_safe_point()
        if not getattr(sys.unraisablehook, "quiet_about_full_disks", False):
            sys.unraisablehook = _quiet_about_full_disks(sys.unraisablehook)

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
                group.create_dataset(name, shape=(0,), maxshape=(None,), dtype="f8",
                                     chunks=(256,), fletcher32=True)  # fmt: skip
        summary = h5.create_group("summary")
        for name in summary_metrics:
            _compact(summary, name, np.nan, "f8")
        _text(h5, "status", "running", STATUS_LENGTH)
        _text(h5, "writer", _writer_id(), WRITER_LENGTH)
        best = h5.create_group("weights/best")
        for name, array in (weights or {}).items():
            _checked_array(best, name, np.zeros_like(array))
        state = h5.create_group("state")
        for slot in (0, 1):
            state.create_dataset(f"blob{slot}", shape=(0,), maxshape=(None,), dtype="u1",
                                 chunks=(1 << 20,), fletcher32=True)  # fmt: skip
            _compact(state, f"size{slot}", 0, "i8")
            _compact(state, f"digest{slot}", np.zeros(32, np.uint8), "u1")
        _compact(state, "current", -1, "i8")
        if extra:
            _write_tree(h5.require_group("results"), extra)
        h5.flush()
        h5.swmr_mode = True
        return cls(h5, path)

    @classmethod
    def reopen(cls, path: Path, *, safe_epoch: int = 0) -> RunFile:
        """Open an existing run file for appending (resume from the state of ``safe_epoch``)."""
        check_run_file(path)
        try:
            h5 = h5py.File(path, "r+", libver="latest")
        except OSError as err:
            if "already open for write" not in str(err):
                raise RunFileError(f"{path} cannot be opened for writing: {err}") from None
            # A writer that died (SIGKILL, power loss, full disk) leaves the SWMR-write flag
            # set, and HDF5 then refuses to open the file for writing. Only when that writer
            # is gone (two live writers would corrupt the file), rewrite its content into a
            # fresh file and swap it in atomically: nothing already written is lost.
            writer = _read_string(path, "writer")
            if _writer_alive(writer):
                raise RunFileError(
                    f"{path} is still being written by process {writer}; wait for it to end "
                    "or stop it before resuming"
                ) from None
            _rewrite(Path(path))
            h5 = h5py.File(path, "r+", libver="latest")
        h5["writer"][()] = _writer_id().encode() if _fixed_text(h5["writer"]) else _writer_id()
        h5.flush()
        h5.swmr_mode = True
        return cls(h5, Path(path), safe_epoch=safe_epoch)

    def _get(self, name: str) -> h5py.Dataset:
        if name not in self._open:
            self._open[name] = self._h5[name]
        return self._open[name]

    def _group(self, name: str) -> list[h5py.Dataset]:
        return [self._get(f"{name}/{key}") for key in self._h5[name].keys()]

    def close(self) -> None:
        if self._stopped:
            return  # after a full disk HDF5 must not write again, not even on close
        if self._h5.id.valid:
            with self._writing("closing the file"):
                self._h5.flush()
                self._open.clear()
                self._h5.close()

    def __enter__(self) -> RunFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing --------------------------------------------------------------------------------

    def append(self, kind: str, row: Mapping[str, float]) -> None:
        """Append one row to ``/metrics/<kind>``; names the file does not know are ignored."""
        with self._writing(f"a row of /metrics/{kind}"):
            length = self.num_rows(kind)
            for dataset in self._group(f"metrics/{kind}"):
                dataset.resize((length + 1,))
                value = row.get(dataset.name.rpartition("/")[2], math.nan)
                dataset[length] = float(value)

    def metrics(self, kind: str) -> dict[str, np.ndarray]:
        """The rows of ``/metrics/<kind>`` written so far (read through the writer's handle)."""
        rows = self.num_rows(kind)
        return {d.name.rpartition("/")[2]: d[:rows] for d in self._group(f"metrics/{kind}")}

    def num_rows(self, kind: str) -> int:
        return min((d.shape[0] for d in self._group(f"metrics/{kind}")), default=0)

    def rows_until(self, kind: str, column: str, limit: float) -> int:
        """How many leading rows of ``/metrics/<kind>`` have ``column <= limit``."""
        values = self._get(f"metrics/{kind}/{column}")[: self.num_rows(kind)]
        return int(np.searchsorted(values, limit, side="right"))

    def truncate(self, kind: str, rows: int) -> None:
        """Drop rows past ``rows`` (metrics written after the state a resume restarts from)."""
        with self._writing(f"/metrics/{kind}"):
            for dataset in self._group(f"metrics/{kind}"):
                if dataset.shape[0] > rows:
                    dataset.resize((rows,))

    def set_status(self, status: str) -> None:
        if self._stopped:
            return
        with self._writing("the status"):
            dataset = self._get("status")
            dataset[()] = status.encode() if _fixed_text(dataset) else status

    def set_summary(self, values: Mapping[str, float]) -> None:
        with self._writing("the summary"):
            names = set(self._h5["summary"].keys())
            for name, value in values.items():
                if name in names:
                    self._get(f"summary/{name}")[()] = float(value)

    def write_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        with self._writing("the best weights"):
            for name, array in weights.items():
                self._get(f"weights/best/{name}")[...] = array

    def write_state(self, state: Mapping[str, Any]) -> None:
        """Store the resumable training state (:func:`symattn_cli.train.state_codec.encode`)
        in the slot not in use, then make it current: a failure on the way leaves the
        previous state whole."""
        from symattn_cli.train.state_codec import encode

        data = encode(state)
        payload = np.frombuffer(data, dtype=np.uint8)
        with self._writing(f"the state of epoch {state.get('epoch', '?')}"):
            slot = 1 - max(0, int(self._get("state/current")[()]))
            blob = self._get(f"state/blob{slot}")
            if blob.shape[0] < payload.shape[0]:
                blob.resize((payload.shape[0],))
            blob[: payload.shape[0]] = payload
            self._get(f"state/size{slot}")[()] = payload.shape[0]
            if f"state/digest{slot}" in self._h5:
                digest = np.frombuffer(hashlib.sha256(data).digest(), dtype=np.uint8)
                self._get(f"state/digest{slot}")[...] = digest
            self._h5.flush()
            self._get("state/current")[()] = slot
            self._h5.flush()
        self.safe_epoch = int(state.get("epoch", self.safe_epoch))
        self._keep_safe_point()

    def flush(self) -> None:
        with self._writing("the file"):
            self._h5.flush()

    # -- a full disk ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        """Turn a write that found no space into :class:`DiskFullError` (one line for people),
        after putting the file back to its last complete state."""
        if self._stopped:
            raise self._full_error(what)
        try:
            yield
        except (OSError, RuntimeError) as err:
            if not _out_of_space(err):
                raise
            self._stop_writing()
            raise self._full_error(what) from None

    def _full_error(self, what: str) -> DiskFullError:
        directory = self.path.parent
        if self.safe_epoch > 0:
            epochs = "epoch 1" if self.safe_epoch == 1 else f"epochs 1-{self.safe_epoch}"
            kept = (f"{self.path} keeps {epochs} and the state of epoch "
                    f"{self.safe_epoch}; free space, then `symattn train resume={directory}` "
                    f"continues from epoch {self.safe_epoch}")  # fmt: skip
        else:
            kept = (f"{self.path} holds no finished epoch yet; free space and start the run "
                    "again")  # fmt: skip
        return DiskFullError(
            f"no space left in {directory} while writing {what}; {kept}",
            path=self.path,
            safe_epoch=self.safe_epoch,
        )

    def _keep_safe_point(self) -> None:
        """Remember the superblock and length of the file as it is now (after a flush)."""
        handle = self._h5.id.get_vfd_handle()
        if not isinstance(handle, int):
            self._safe_point = None
            return
        self._safe_point = (_superblock(handle), os.fstat(handle).st_size)

    def _stop_writing(self) -> None:
        """Keep HDF5 from writing to the file again and put the file back as it was after the
        last complete state: that superblock, that length.

        HDF5 goes on writing after a failed write (its superblock at once, with an end of
        file past what reached the disk; the rest on close, which may crash): its descriptor
        is pointed at a read-only one first, so every later write of its fails harmlessly."""
        self._stopped = True
        handle = self._h5.id.get_vfd_handle()
        if not isinstance(handle, int):
            return
        read_only = os.open(self.path, os.O_RDONLY)
        try:
            os.dup2(read_only, handle)
        finally:
            os.close(read_only)
        if self._safe_point is None:
            return
        superblock, length = self._safe_point
        repair = os.open(self.path, os.O_WRONLY)
        try:
            os.pwrite(repair, superblock, 0)  # in place: needs no free space
            os.ftruncate(repair, length)  # shrinking frees what the failed epoch took
            os.fsync(repair)
        finally:
            os.close(repair)

    @property
    def stopped(self) -> bool:
        """Whether a full disk stopped the writing (the process should end without HDF5
        closing the file: :func:`symattn_cli.commands.common.user_errors_exit`)."""
        return self._stopped


def _quiet_about_full_disks(hook: Callable[[Any], None]) -> Callable[[Any], None]:
    """An unraisable-exception hook that drops what h5py reports while freeing objects whose
    writes found no space (or, after :meth:`RunFile._stop_writing`, no writable file): the
    one-line :class:`DiskFullError` says it instead. Everything else goes to ``hook``."""

    def quiet(unraisable: Any) -> None:
        error = unraisable.exc_value
        if isinstance(error, (RuntimeError, OSError)) and (
            _out_of_space(error) or f"errno = {errno.EBADF}," in str(error)
        ):
            return
        hook(unraisable)

    quiet.quiet_about_full_disks = True
    return quiet


class NullRunFile:
    """Stands in for the run file on processes that must not write (torchrun ranks > 0)."""

    path = Path("/dev/null")
    safe_epoch = 0
    stopped = False

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
    with _open(path) as h5:
        group = _item(h5, path, f"results/{table}")
        out = {}
        for name, dataset in group.items():
            values = _read(dataset, path)
            if h5py.check_string_dtype(dataset.dtype) is not None:
                values = np.array([v.decode() if isinstance(v, bytes) else v for v in values])
            out[name] = values
        return out


def _rewrite(path: Path) -> None:
    """Copy a run file left open by a dead writer into a clean file at the same path."""
    fresh = path.with_name(path.name + ".rewrite")
    with _open(path) as old:
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
    with _open(path) as h5:
        return _string(_read(_item(h5, path, name), path))


def _string(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fixed_text(dataset: h5py.Dataset) -> bool:
    """Whether a text dataset is fixed-length (format 3) rather than variable-length."""
    info = h5py.check_string_dtype(dataset.dtype)
    return info is not None and info.length is not None


def _write_tree(group: h5py.Group, tree: Mapping[str, Any]) -> None:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            _write_tree(group.require_group(key), value)
        elif isinstance(value, str):
            _text(group, key, value, max(1, len(value.encode())))
        elif isinstance(value, np.ndarray) and value.dtype.kind in "OU":
            encoded = [str(v).encode() for v in value.ravel()]
            length = max([1, *map(len, encoded)])
            data = np.array(encoded, dtype=h5py.string_dtype("utf-8", length)).reshape(value.shape)
            _checked_array(group, key, data)
        else:
            _checked_array(group, key, np.asarray(value))


def _out_of_space(err: BaseException) -> bool:
    """Whether an h5py error comes from a write that found no space (its errno, or the one
    HDF5 quotes in its message)."""
    if isinstance(err, OSError) and err.errno in SPACE_ERRNOS:
        return True
    return any(int(code) in SPACE_ERRNOS for code in re.findall(r"errno = (\d+)", str(err)))


def _superblock(handle: int) -> bytes:
    """The superblock (version 2 or 3, as ``libver="latest"`` writes it) at the file's start."""
    head = os.pread(handle, 10, 0)
    offsets = head[9] if len(head) == 10 else 8
    return os.pread(handle, 12 + 4 * offsets + 4, 0)


def _writer_flags(path: Path) -> bool:
    """Whether the superblock (version 2 or 3) says a writer holds the file: set while a
    writer has it open, and left set by one that died."""
    with open(path, "rb") as handle:
        head = handle.read(12)
    return len(head) == 12 and head[8] in (2, 3) and head[11] != 0


def _cut_short(path: Path) -> str:
    """Why the file is shorter than HDF5's record of its end, or ``""`` when it is not: the
    end-of-file check HDF5 makes on a plain open, made by hand for files that must be read
    through SWMR (only superblocks of version 2 and 3 record it where this reads it)."""
    with open(path, "rb") as handle:
        head = handle.read(64)
    if len(head) < 12 or head[8] not in (2, 3):
        return ""
    offsets = head[9]
    fmt = {4: "<I", 8: "<Q"}.get(offsets)
    if fmt is None or len(head) < 12 + 4 * offsets:
        return ""
    (stored,) = struct.unpack_from(fmt, head, 12 + 2 * offsets)
    size = os.path.getsize(path)
    if size >= stored:
        return ""
    return f"it is cut short: {size} of its {stored} bytes are there"


def _lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 ``hashlittle``: the checksum HDF5 puts on its metadata."""
    mask = 0xFFFFFFFF

    def rot(x: int, k: int) -> int:
        return ((x << k) | (x >> (32 - k))) & mask

    def word(at: int) -> int:
        return int.from_bytes(data[at : at + 4], "little")

    a = b = c = (0xDEADBEEF + len(data) + initval) & mask
    at, left = 0, len(data)
    while left > 12:
        a, b, c = (a + word(at)) & mask, (b + word(at + 4)) & mask, (c + word(at + 8)) & mask
        for shift_a, shift_b, shift_c in ((4, 6, 8), (16, 19, 4)):  # lookup3's mix()
            a = ((a - c) & mask) ^ rot(c, shift_a)
            c = (c + b) & mask
            b = ((b - a) & mask) ^ rot(a, shift_b)
            a = (a + c) & mask
            c = ((c - b) & mask) ^ rot(b, shift_c)
            b = (b + a) & mask
        at, left = at + 12, left - 12
    if left == 0:
        return c
    tail = data[at:] + bytes(12 - left)
    a = (a + int.from_bytes(tail[0:4], "little")) & mask
    b = (b + int.from_bytes(tail[4:8], "little")) & mask
    c = (c + int.from_bytes(tail[8:12], "little")) & mask
    final = ((14, "c"), (11, "a"), (25, "b"), (16, "c"), (4, "a"), (14, "b"), (24, "c"))
    for shift, target in final:  # lookup3's final(): x ^= y; x -= rot(y, k)
        if target == "c":
            c = ((c ^ b) - rot(b, shift)) & mask
        elif target == "a":
            a = ((a ^ c) - rot(c, shift)) & mask
        else:
            b = ((b ^ a) - rot(a, shift)) & mask
    return c


class _WithoutWriterFlags(io.RawIOBase):
    """A run file, read-only, as if its writer had closed it: the superblock's consistency
    flags (set by a writer that died) read as cleared, its checksum redone. HDF5 can then
    open it plainly, with its own end-of-file check and without SWMR's retries, which turn a
    failed checksum into minutes of waiting. The file itself is not changed."""

    def __init__(self, path: Path, superblock: bytes) -> None:
        super().__init__()
        self._file = open(path, "rb")  # noqa: SIM115 - closed with this object
        self._head = superblock
        self._position = 0

    @classmethod
    def of(cls, path: Path) -> _WithoutWriterFlags | None:
        with open(path, "rb") as handle:
            head = handle.read(64)
        if len(head) < 12 or head[8] not in (2, 3) or head[9] not in (4, 8):
            return None
        size = 12 + 4 * head[9]
        stored = int.from_bytes(head[size : size + 4], "little")
        if len(head) < size + 4 or _lookup3(head[:size]) != stored:
            return None
        body = head[:11] + b"\x00" + head[12:size]
        return cls(path, body + _lookup3(body).to_bytes(4, "little"))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._position = self._file.seek(offset, whence)
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer) -> int:
        self._file.seek(self._position)
        count = self._file.readinto(buffer)
        if count and self._position < len(self._head):
            overlap = min(count, len(self._head) - self._position)
            view = memoryview(buffer)
            view[:overlap] = self._head[self._position : self._position + overlap]
        self._position += count or 0
        return count or 0

    def close(self) -> None:
        self._file.close()
        super().close()


# -- reading ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _open(path: Path) -> Iterator[h5py.File]:
    """Open a run file for reading; unless its writer is alive, check it whole first.

    A plain open makes HDF5 compare the file's length with the end it recorded. A file whose
    writer holds it (or died holding it) is refused by a plain open, and SWMR skips that
    comparison: such a file is opened plainly as if closed (:func:`_open_held`), and through
    SWMR only while its writer runs on this host. A file not being written is then read in
    full once (:func:`_check_whole`). Raises
    :class:`DamagedRunFileError` for a file cut short or failing a checksum,
    :class:`RunFileError` for one that is not a run file or not there."""
    path = Path(path)
    if not path.is_file():
        raise RunFileError(f"run file {path} does not exist; pass a run directory or its run.h5")
    live, source = False, None
    try:
        h5 = h5py.File(path, "r", libver="latest")
    except OSError as err:
        text = str(err)
        if "truncated file" in text:
            sizes = re.search(r"eof = (\d+).*stored_eof = (\d+)", text)
            what = (f"it is cut short: {sizes[1]} of its {sizes[2]} bytes are there" if sizes
                    else "it is cut short")  # fmt: skip
            if not _writer_flags(path):
                raise _damaged(path, what) from None
            # held by a writer, which may be extending it this moment: a live writer's file is
            # read through SWMR; a dead writer's is checked for its length there
            h5, live = _open_swmr(path)
        elif "unable to lock file, errno = 11" in text:
            # A process holds the file this moment (locks die with their process): a live
            # writer, read through SWMR; an OSError here means it is not readable yet.
            h5, live = h5py.File(path, "r", libver="latest", swmr=True), True
        elif "already open for write" not in text:
            raise RunFileError(
                f"{path} cannot be read as HDF5 ({_first_line(err)}); it is corrupt or not a "
                "run file. Pass the run.h5 written by `symattn train` (to resume a run whose "
                "file is lost, start a new one without resume=)"
            ) from None
        else:
            h5, live, source = _open_held(path)
    try:
        if not live:
            _check_whole(h5, path)
        yield h5
    finally:
        h5.close()
        if source is not None:
            source.close()


def _open_held(path: Path) -> tuple[h5py.File, bool, io.RawIOBase | None]:
    """A file whose SWMR-write flag is set: ``(handle, writer alive, source to close)``.

    Opened plainly through :class:`_WithoutWriterFlags` (HDF5 then checks its length and
    fails fast on a bad checksum); reopened through SWMR only if the writer it names runs on
    this host."""
    source = _WithoutWriterFlags.of(path)
    if source is None:  # a superblock this does not know: SWMR and the length check by hand
        return (*_open_swmr(path), None)
    try:
        h5 = h5py.File(source, "r")
    except OSError as err:
        source.close()
        sizes = re.search(r"eof = (\d+).*stored_eof = (\d+)", str(err))
        if sizes:
            raise _damaged(path, f"it is cut short: {sizes[1]} of its {sizes[2]} bytes are "
                                 "there") from None  # fmt: skip
        raise _damaged(path, f"HDF5 cannot open it ({_first_line(err)})") from None
    try:
        writer = _string(_read(_item(h5, path, "writer"), path))
    except BaseException:
        h5.close()
        source.close()
        raise
    if writer.rpartition(":")[0] == socket.gethostname() and _writer_alive(writer):
        h5.close()
        source.close()
        return h5py.File(path, "r", libver="latest", swmr=True), True, None
    return h5, False, source


def _open_swmr(path: Path) -> tuple[h5py.File, bool]:
    """The file opened through SWMR, and whether its writer is alive on this host."""
    try:
        h5 = h5py.File(path, "r", libver="latest", swmr=True)
    except OSError as err:
        raise _damaged(path, f"HDF5 cannot open it ({_first_line(err)})") from None
    try:
        writer = _string(_read(_item(h5, path, "writer"), path))
        live = writer.rpartition(":")[0] == socket.gethostname() and _writer_alive(writer)
        cut = "" if live else _cut_short(path)
        if cut:
            raise _damaged(path, cut)
    except BaseException:
        h5.close()
        raise
    return h5, live


def _damaged(path: Path, what: str) -> DamagedRunFileError:
    return DamagedRunFileError(
        f"{path} is damaged: {what}; none of it is read. Use an intact copy (to resume a run "
        "whose file is damaged, start it again without resume=)"
    )


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _item(group: h5py.Group, path: Path, name: str) -> Any:
    """``group[name]``; an object HDF5 cannot open (its header fails its checksum) becomes
    :class:`DamagedRunFileError` naming it."""
    try:
        return group[name]
    except (KeyError, OSError, RuntimeError) as err:
        if isinstance(err, KeyError) and "checksum" not in str(err):
            raise  # not there: a missing name, not damage
        where = f"{group.name.rstrip('/')}/{name}"
        raise _damaged(path, f"{where} cannot be read ({_first_line(err)})") from None


def _read(dataset: h5py.Dataset, path: Path, rows: slice | None = None) -> Any:
    """The values of ``dataset``; a chunk that fails its checksum (or cannot be read at all)
    becomes :class:`DamagedRunFileError` naming the dataset."""
    try:
        return dataset[()] if rows is None else dataset[rows]
    except (OSError, RuntimeError, KeyError, ValueError) as err:
        text = str(err)
        if "filter returned failure" in text:
            what = f"{dataset.name} fails its checksum"
        else:
            what = f"{dataset.name} cannot be read ({_first_line(err)})"
        raise _damaged(path, what) from None


# Files already checked whole, by (path, inode, size, modification time): a report reads
# each file several times.
_CHECKED: dict[tuple[str, int, int, int], str] = {}


def _check_whole(h5: h5py.File, path: Path) -> None:
    """Read every dataset of a file no one is writing, so that HDF5 verifies every checksum
    (of the state: the current slot's bytes and digest; the other slot is scratch space that
    the next state overwrites). A foreign file raises :class:`RunFileError`."""
    stat = os.stat(path)
    key = (str(Path(path).resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key in _CHECKED:
        return
    fmt = h5.attrs.get("format")
    if fmt != FORMAT:
        raise RunFileError(
            f"{path} is an HDF5 file but not a symattn run file (format={fmt!r}); "
            "pass the run.h5 written by `symattn train`"
        )
    try:
        for dataset in _datasets(h5, path):
            if not re.fullmatch(r"/state/blob\d", dataset.name):
                _read(dataset, path)
        if "state" in h5:
            _current_state_bytes(h5, path)
    except (OSError, RuntimeError, KeyError, ValueError) as err:
        raise _damaged(path, f"HDF5 cannot read it ({_first_line(err)})") from None
    version = int(h5.attrs.get("format_version", 1))
    note = ""
    if version < CHECKSUM_VERSION:
        note = (f"{path} is a run file of format {version}, written before run files carried "
                "checksums: damage in it cannot be detected")  # fmt: skip
    _CHECKED[key] = note


def _datasets(group: h5py.Group, path: Path) -> Iterator[h5py.Dataset]:
    """Every dataset below ``group``, opened one by one, so that an object whose header fails
    its checksum is named."""
    for key in group.keys():
        item = _item(group, path, key)
        if isinstance(item, h5py.Group):
            yield from _datasets(item, path)
        elif isinstance(item, h5py.Dataset):
            yield item


def check_run_file(path: Path) -> str:
    """Check that ``path`` is a whole, undamaged symattn run file (every checksum, unless its
    writer is still writing it); return a one-line note for a file of a format without
    checksums, else ``""``.

    Raises :class:`DamagedRunFileError` naming the file and what is wrong, or
    :class:`RunFileError` for a file that is missing or not a run file."""
    path = Path(path)
    with _open(path) as h5:
        if h5.attrs.get("format") != FORMAT:  # a live file skips the whole check
            raise RunFileError(
                f"{path} is an HDF5 file but not a symattn run file "
                f"(format={h5.attrs.get('format')!r}); pass the run.h5 written by `symattn train`"
            )
        version = int(h5.attrs.get("format_version", 1))
    if version < CHECKSUM_VERSION:
        return (f"{path} is a run file of format {version}, written before run files carried "
                "checksums: damage in it cannot be detected")  # fmt: skip
    return ""


def _current_state_bytes(h5: h5py.File, path: Path) -> bytes | None:
    """The bytes of the current state, checked against its digest (format 3), or None."""
    slot = int(_read(_item(h5, path, "state/current"), path))
    if slot < 0:
        return None
    if slot not in (0, 1):
        raise _damaged(path, f"/state/current holds {slot}, not a slot (0 or 1)")
    size = int(_read(_item(h5, path, f"state/size{slot}"), path))
    blob = _item(h5, path, f"state/blob{slot}")
    if not 0 <= size <= blob.shape[0]:
        raise _damaged(path, f"/state/size{slot} says {size} bytes, the blob holds "
                             f"{blob.shape[0]}")  # fmt: skip
    payload = _read(blob, path, slice(0, size)).tobytes()
    if f"state/digest{slot}" in h5:
        stored = _read(_item(h5, path, f"state/digest{slot}"), path).tobytes()
        if hashlib.sha256(payload).digest() != stored:
            raise _damaged(path, f"the training state (/state/blob{slot}) does not match its "
                                 "digest")  # fmt: skip
    return payload


def read_metrics(path: Path, kind: str = "epoch") -> dict[str, np.ndarray]:
    """The metrics table of a run file, safe to call while the run is writing it."""
    with _open(path) as h5:
        group = _item(h5, path, f"metrics/{kind}")
        columns = {}
        for name, dataset in group.items():
            dataset.refresh()
            columns[name] = _read(dataset, path, slice(None))
        rows = min((len(c) for c in columns.values()), default=0)
        return {name: column[:rows] for name, column in columns.items()}


def read_summary(path: Path) -> dict[str, float]:
    with _open(path) as h5:
        return {name: float(_read(d, path)) for name, d in _item(h5, path, "summary").items()}


def read_status(path: Path) -> str:
    return _read_string(path, "status")


def read_config_yaml(path: Path) -> str:
    with _open(path) as h5:
        return str(_item(h5, path, "config").attrs["yaml"])


def read_choices_yaml(path: Path) -> str:
    """The config-group options the run was composed from (YAML), or ``""`` if not stored."""
    with _open(path) as h5:
        return str(_item(h5, path, "config").attrs.get("choices", ""))


def read_env(path: Path) -> dict[str, Any]:
    """The ``/env`` attributes: commit, versions, device, threads."""
    with _open(path) as h5:
        return {key: _plain(value) for key, value in _item(h5, path, "env").attrs.items()}


def read_command(path: Path) -> str:
    """The command that wrote the file (``train``, ``benchmark``, ...)."""
    with _open(path) as h5:
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
    with _open(path) as h5:
        best = _item(h5, path, "weights/best")
        return {name: np.asarray(_read(d, path)) for name, d in best.items()}


def read_state(path: Path) -> dict[str, Any] | None:
    """The resumable state stored in a run file, or ``None`` if none was written yet.

    Decoding runs no code whatever the file holds: anything but a state in
    :mod:`symattn_cli.train.state_codec`'s format (a format 1 pickle, damaged or crafted
    bytes) raises :class:`RunFileError`, and the file is left as it is. A state that does not
    match its digest raises :class:`DamagedRunFileError`.
    """
    from symattn_cli.train.state_codec import StateFormatError, decode

    try:
        with _open(path) as h5:
            payload = _current_state_bytes(h5, path)
    except (OSError, KeyError, ValueError, TypeError) as err:
        raise RunFileError(f"{path}: its training state cannot be read ({err})") from None
    if payload is None:
        return None
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
