"""Damaged run files are detected, never read as data; a full disk stops the writer with the
file resumable from its last complete state; files without checksums stay readable."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from symattn_cli.train.runfile import (
    DamagedRunFileError,
    RunFile,
    _WithoutWriterFlags,
    check_run_file,
    read_metrics,
    read_state,
    read_status,
    read_summary,
    read_weights,
)
from tests.helpers import symattn_env

READERS = (check_run_file, read_metrics, read_summary, read_status, read_weights, read_state)


def write(path: Path, epochs: int = 3) -> Path:
    """A finished run file of ``epochs`` epochs, each with weights and a state."""
    run = RunFile.create(
        path,
        command="train",
        config_yaml="seed: 0\n",
        env={"torch": "x"},
        epoch_metrics=["epoch", "val_acc"],
        step_metrics=["step", "loss"],
        summary_metrics=["test_acc"],
        weights={"w": np.zeros((64, 64), dtype=np.float32), "n": np.int64(0)},
    )
    rng = np.random.default_rng(0)
    with run:
        for epoch in range(1, epochs + 1):
            run.append("epoch", {"epoch": epoch, "val_acc": epoch / 10})
            run.write_weights({"w": rng.normal(size=(64, 64)).astype(np.float32)})
            run.write_state({"epoch": epoch, "model": rng.normal(size=5000)})
        run.set_summary({"test_acc": 0.75})
        run.set_status("finished")
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("good") / "run.h5")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_refused_everywhere(path: Path, what: str) -> None:
    """Every reader raises :class:`DamagedRunFileError` naming the file and ``what``, and the
    file is left as it was."""
    before = digest(path)
    for reader in READERS:
        with pytest.raises(DamagedRunFileError) as info:
            reader(path)
        message = str(info.value)
        assert str(path) in message and "is damaged" in message and what in message, message
        assert "\n" not in message
    assert digest(path) == before


def test_a_whole_file_reads_back(good):
    assert check_run_file(good) == ""
    assert read_metrics(good)["epoch"].tolist() == [1.0, 2.0, 3.0]
    assert read_state(good)["epoch"] == 3
    assert read_summary(good) == {"test_acc": 0.75}


@pytest.mark.parametrize("fraction", [0.02, 0.3, 0.6, 0.95, 0.9995])
def test_a_truncated_file_is_damaged(good, tmp_path, fraction):
    cut = tmp_path / "run.h5"
    data = good.read_bytes()
    cut.write_bytes(data[: int(len(data) * fraction)])
    assert_refused_everywhere(cut, "cut short")


def _offset(path: Path, name: str) -> int:
    """Where the bytes of dataset ``name`` start (its first chunk, or its data)."""
    with h5py.File(path, "r") as h5:
        dataset = h5[name]
        if dataset.chunks:
            return dataset.id.get_chunk_info(0).byte_offset
        return dataset.id.get_offset()


def _current_blob(path: Path) -> str:
    with h5py.File(path, "r") as h5:
        return f"state/blob{int(h5['state/current'][()])}"


@pytest.mark.parametrize(
    "name, shift, what",
    [
        ("weights/best/w", 1000, "/weights/best/w fails its checksum"),
        ("metrics/epoch/val_acc", 9, "/metrics/epoch/val_acc fails its checksum"),
        ("state", 3000, "fails its checksum"),
    ],
    ids=["weights", "metrics", "state"],
)
def test_a_flipped_byte_is_damage(good, tmp_path, name, shift, what):
    if name == "state":
        name = _current_blob(good)
        what = f"/{name} {what}"
    flipped = tmp_path / "run.h5"
    shutil.copy(good, flipped)
    offset = _offset(good, name) + shift
    with open(flipped, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 0x10]))
    assert_refused_everywhere(flipped, what)


def test_a_flipped_byte_in_a_scalar_fails_its_header_checksum(good, tmp_path):
    """Summary, status and the state pointer live inside object headers, which HDF5
    checksums: a changed value there is damage too."""
    flipped = tmp_path / "run.h5"
    data = bytearray(good.read_bytes())
    at = data.find(np.float64(0.75).tobytes())
    assert at > 0 and data.find(np.float64(0.75).tobytes(), at + 1) < 0
    data[at + 7] ^= 0x01  # 0.75 -> another number
    flipped.write_bytes(bytes(data))
    assert_refused_everywhere(flipped, "summary/test_acc")


# A writer killed while writing epoch 3: its row is appended and its state half written.
KILLED_IN_EPOCH = """
import os, signal, sys
import numpy as np
from symattn_cli.train.runfile import RunFile
run = RunFile.create(sys.argv[1], command="train", config_yaml="", env={},
                     epoch_metrics=["epoch"], step_metrics=[], summary_metrics=[])
for epoch in (1, 2):
    run.append("epoch", {"epoch": epoch})
    run.write_state({"epoch": epoch, "model": np.full(300_000, epoch, dtype=np.float64)})
run.append("epoch", {"epoch": 3})
blob = run._h5["state/blob1"]
blob[:1000] = np.full(1000, 7, dtype=np.uint8)  # a state write cut off by the kill
run._h5.flush()
print(os.path.getsize(sys.argv[1]), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_file_cut_during_the_write_of_an_epoch(tmp_path):
    """Killed in the middle of an epoch, a file keeps the previous epoch's state; cut short
    as well (a copy of it taken half way), it is damaged, though its writer's SWMR flag means
    HDF5 itself cannot check its length."""
    path = tmp_path / "killed" / "run.h5"
    result = subprocess.run([sys.executable, "-c", KILLED_IN_EPOCH, str(path)],
                            env=symattn_env(), capture_output=True, text=True)  # fmt: skip
    assert result.returncode == -9, result.stderr
    assert check_run_file(path) == ""
    source = _WithoutWriterFlags.of(path)  # read plainly, not through SWMR
    assert source is not None
    source.close()
    assert read_state(path)["epoch"] == 2  # the state being written is not current
    assert read_metrics(path)["epoch"].tolist() == [1.0, 2.0, 3.0]
    assert read_status(path) == "running"
    with pytest.raises(OSError, match="already open for write"):
        h5py.File(path, "r")  # the case HDF5's own length check cannot reach
    for keep in (0.5, 0.99):
        cut = tmp_path / f"cut{keep}" / "run.h5"
        cut.parent.mkdir()
        data = path.read_bytes()
        cut.write_bytes(data[: int(len(data) * keep)])
        assert_refused_everywhere(cut, "cut short")
    # the kill lost nothing that was finished: the file resumes from epoch 2
    with RunFile.reopen(path, safe_epoch=2) as run:
        run.truncate("epoch", 2)
        run.append("epoch", {"epoch": 3})
        run.write_state({"epoch": 3})
    assert read_metrics(path)["epoch"].tolist() == [1.0, 2.0, 3.0]
    assert read_state(path) == {"epoch": 3}


# Writes epochs until the file may grow no further: the size limit of a file (RLIMIT_FSIZE)
# makes the system's writes fail as a full disk does, at a byte chosen by the test.
FULL_DISK = """
import errno, os, resource, signal, sys
import numpy as np
from symattn_cli.train.runfile import DiskFullError, RunFile
path, limit = sys.argv[1], int(sys.argv[2])
run = RunFile.create(path, command="train", config_yaml="", env={},
                     epoch_metrics=["epoch", "val_acc"], step_metrics=[], summary_metrics=[],
                     weights={"w": np.zeros(1000, dtype=np.float32)})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
try:
    for epoch in range(1, 100):
        run.append("epoch", {"epoch": epoch, "val_acc": epoch / 100})
        run.write_weights({"w": np.full(1000, epoch, dtype=np.float32)})
        model = np.full(40_000 * epoch, epoch, dtype=np.float64)  # a state that grows
        run.write_state({"epoch": epoch, "model": model})
except DiskFullError as err:
    run.set_status("failed")  # ignored: HDF5 writes nothing after a full disk
    run.close()
    print(err, flush=True)
    os._exit(2)
"""


def fill_disk(path: Path, limit: int) -> str:
    """Run :data:`FULL_DISK`; return the one line it ends with."""
    result = subprocess.run([sys.executable, "-c", FULL_DISK, str(path), str(limit)],
                            env=symattn_env(), capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2, result.stderr  # no crash on the way out
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and result.stderr == "", result.stdout + result.stderr
    assert lines[0].startswith(f"no space left in {path.parent} while writing"), lines[0]
    return lines[0]


@pytest.mark.parametrize("limit", [
    1_500_000,
    pytest.param(3_000_000, marks=pytest.mark.slow),
    pytest.param(5_500_000, marks=pytest.mark.slow),
])  # fmt: skip
def test_a_full_disk_keeps_the_last_complete_state(tmp_path, limit):
    """Stopped at different epochs (the state grows each epoch), the file keeps every epoch
    up to the last complete state, checks whole, and goes on from there."""
    path = tmp_path / "run" / "run.h5"
    line = fill_disk(path, limit)
    safe = int(line.split("continues from epoch ")[1])
    assert safe >= 1 and f"and the state of epoch {safe};" in line
    assert check_run_file(path) == ""  # whole: not cut short, every checksum right
    assert read_state(path)["epoch"] == safe
    np.testing.assert_array_equal(read_state(path)["model"], np.full(40_000 * safe, safe))
    epochs = read_metrics(path)["epoch"].tolist()
    assert epochs[:safe] == [float(e) for e in range(1, safe + 1)]
    # with space again, the run goes on from that epoch
    with RunFile.reopen(path, safe_epoch=safe) as run:
        run.truncate("epoch", safe)
        for epoch in range(safe + 1, safe + 4):
            run.append("epoch", {"epoch": epoch, "val_acc": epoch / 100})
            run.write_state({"epoch": epoch})
        run.set_status("finished")
    assert check_run_file(path) == ""
    assert read_metrics(path)["epoch"].tolist() == [float(e) for e in range(1, safe + 4)]
    assert read_state(path) == {"epoch": safe + 3} and read_status(path) == "finished"


def test_a_disk_full_before_the_first_state_says_so(tmp_path):
    line = fill_disk(tmp_path / "run" / "run.h5", 20_000)
    assert "holds no finished epoch yet; free space and start the run again" in line


def test_lookup3_matches_its_reference_values():
    """The hash that lets a dead writer's file be opened with HDF5's own checks (values from
    lookup3.c's self-test)."""
    from symattn_cli.train.runfile import _lookup3

    text = b"Four score and seven years ago"
    assert _lookup3(text, 0) == 0x17770551
    assert _lookup3(text, 1) == 0xCD628161
    assert _lookup3(b"", 0) == 0xDEADBEEF


def write_format_2(path: Path) -> Path:
    """A run file as format 2 wrote it: no filters, contiguous scalars, variable-length text."""
    with h5py.File(path, "w", libver="latest") as h5:
        h5.attrs["format"] = "symattn-run"
        h5.attrs["format_version"] = 2
        h5.attrs["command"] = "train"
        h5.create_group("config").attrs["yaml"] = "seed: 0\n"
        h5.create_group("env").attrs["torch"] = "x"
        h5.create_dataset("metrics/epoch/epoch", data=[1.0, 2.0], maxshape=(None,), chunks=(256,))
        h5.create_group("metrics/step")
        h5.create_dataset("summary/test_acc", data=0.5)
        h5.create_dataset("status", data="finished", dtype=h5py.string_dtype("utf-8"))
        h5.create_dataset("writer", data="elsewhere:1", dtype=h5py.string_dtype("utf-8"))
        h5.create_dataset("weights/best/w", data=np.ones(3, dtype=np.float32))
        for slot in (0, 1):
            h5.create_dataset(f"state/blob{slot}", shape=(0,), maxshape=(None,), dtype="u1",
                              chunks=(1 << 20,))  # fmt: skip
            h5.create_dataset(f"state/size{slot}", data=0, dtype="i8")
        h5.create_dataset("state/current", data=-1, dtype="i8")
    return path


def test_files_without_checksums_stay_readable_with_a_note(tmp_path):
    path = write_format_2(tmp_path / "run.h5")
    note = check_run_file(path)
    assert str(path) in note and "format 2" in note and "checksums" in note
    assert "\n" not in note
    assert read_metrics(path)["epoch"].tolist() == [1.0, 2.0]
    np.testing.assert_array_equal(read_weights(path)["w"], np.ones(3))
    assert read_summary(path) == {"test_acc": 0.5} and read_status(path) == "finished"
    with RunFile.reopen(path) as run:  # resume writes on in the old layout
        run.append("epoch", {"epoch": 3.0})
        run.write_state({"epoch": 3})
        run.set_status("finished")
    assert read_state(path) == {"epoch": 3} and read_status(path) == "finished"


def test_a_live_writers_file_mid_extension_is_read_not_refused(tmp_path, good, monkeypatch):
    """A plain open can find a live writer's file shorter than its recorded end while the
    writer extends it: read through SWMR, not refused. A closed file that HDF5 finds short
    (no writer holds it) is damaged."""
    import symattn_cli.train.runfile as runfile

    plain = h5py.File

    def extending(path, mode="r", *args, **kwargs):
        if mode == "r" and not kwargs.get("swmr"):
            raise OSError("unable to open file (truncated file: eof = 100, stored_eof = 200)")
        return plain(path, mode, *args, **kwargs)

    live = RunFile.create(tmp_path / "run.h5", command="train", config_yaml="seed: 0\n",
                          env={}, epoch_metrics=["epoch"], step_metrics=["step"],
                          summary_metrics=[])  # fmt: skip
    with live:
        live.append("epoch", {"epoch": 1})
        live._h5.flush()
        monkeypatch.setattr(runfile.h5py, "File", extending)
        assert read_metrics(tmp_path / "run.h5")["epoch"].tolist() == [1.0]
        with pytest.raises(DamagedRunFileError, match="cut short: 100 of its 200 bytes"):
            read_metrics(good)
