"""The HDF5 run file: schema, live reading from another process, crash safety, bad files."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest

from symattn_cli.train.runfile import (
    RunFile,
    RunFileError,
    check_run_file,
    read_metrics,
    read_state,
    read_status,
    read_summary,
    read_table,
    read_weights,
    write_results_file,
)


def make(path):
    return RunFile.create(
        path,
        command="train",
        config_yaml="seed: 0\n",
        env={"torch": "x", "threads": 2, "git_dirty": False},
        epoch_metrics=["epoch", "val_acc"],
        step_metrics=["step", "loss"],
        summary_metrics=["test_acc"],
        weights={"w": np.zeros((2, 3), dtype=np.float32)},
    )


def test_schema_round_trip(tmp_path):
    path = tmp_path / "run.h5"
    with make(path) as run:
        for epoch in range(3):
            run.append("epoch", {"epoch": epoch + 1, "val_acc": 0.5 + epoch / 10})
        run.write_weights({"w": np.ones((2, 3), dtype=np.float32)})
        run.write_state({"epoch": 3, "blob": list(range(10))})
        run.write_state({"epoch": 4})  # second slot
        run.set_summary({"test_acc": 0.9})
        run.set_status("finished")
    metrics = read_metrics(path)
    np.testing.assert_allclose(metrics["val_acc"], [0.5, 0.6, 0.7])
    assert read_summary(path) == {"test_acc": 0.9}
    assert read_status(path) == "finished"
    assert read_state(path) == {"epoch": 4}
    np.testing.assert_array_equal(read_weights(path)["w"], np.ones((2, 3)))
    with h5py.File(path, "r") as h5:
        assert h5.attrs["format"] == "symattn-run"
        assert h5["config"].attrs["yaml"] == "seed: 0\n"
        assert h5["env"].attrs["threads"] == 2


def test_truncate_and_rows_until(tmp_path):
    with make(tmp_path / "run.h5") as run:
        for step in range(1, 6):
            run.append("step", {"step": step * 10, "loss": 1.0 / step})
        assert run.rows_until("step", "step", 30) == 3
        run.truncate("step", 3)
        assert run.num_rows("step") == 3


READER = """
import sys, time
from symattn_cli.train.runfile import read_metrics
deadline = time.time() + 60
while time.time() < deadline:
    rows = len(read_metrics(sys.argv[1]).get("epoch", []))
    if rows >= 2:
        print("seen", rows)
        break
    time.sleep(0.05)
"""


def test_another_process_reads_metrics_while_writing(tmp_path):
    path = tmp_path / "run.h5"
    run = make(path)
    reader = subprocess.Popen([sys.executable, "-c", READER, str(path)], stdout=subprocess.PIPE)
    try:
        for epoch in range(2):
            run.append("epoch", {"epoch": epoch + 1, "val_acc": 0.1})
            run.flush()
        out, _ = reader.communicate(timeout=90)
    finally:
        run.close()
    assert out.decode().startswith("seen 2")


KILLED_WRITER = """
import os, signal, sys
import numpy as np
from symattn_cli.train.runfile import RunFile
run = RunFile.create(sys.argv[1], command="train", config_yaml="", env={},
                     epoch_metrics=["epoch"], step_metrics=[], summary_metrics=[])
for epoch in range(3):
    run.append("epoch", {"epoch": epoch + 1})
    run.write_state({"epoch": epoch + 1})
    run.flush()
run.append("epoch", {"epoch": 4})  # not flushed: lost with the process
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_sigkilled_writer_keeps_flushed_epochs(tmp_path):
    path = tmp_path / "run.h5"
    result = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(path)])
    assert result.returncode == -9
    check_run_file(path)
    assert read_metrics(path)["epoch"][:3].tolist() == [1.0, 2.0, 3.0]
    assert read_state(path) == {"epoch": 3}
    assert read_status(path) == "running"


def test_foreign_and_corrupt_files_are_refused(tmp_path):
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as h5:
        h5["x"] = 1
    with pytest.raises(RunFileError, match="not a symattn run file"):
        check_run_file(foreign)
    corrupt = tmp_path / "corrupt.h5"
    corrupt.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)
    with pytest.raises(RunFileError, match="corrupt or not a run file"):
        check_run_file(corrupt)
    with pytest.raises(RunFileError, match="does not exist"):
        check_run_file(tmp_path / "missing.h5")


def test_results_tables(tmp_path):
    path = write_results_file(
        tmp_path / "verify.h5",
        command="verify-equivariance",
        config_yaml="",
        env={},
        tables={"checks": [{"group": "r4", "rel": 1e-16}, {"group": "r8", "rel": 2e-3}]},
        summary={"failures": 0},
    )
    table = read_table(path, "checks")
    assert table["group"].tolist() == ["r4", "r8"]
    np.testing.assert_allclose(table["rel"], [1e-16, 2e-3])
    assert read_summary(path) == {"failures": 0.0}
