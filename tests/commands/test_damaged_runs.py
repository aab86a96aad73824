"""Damaged run files through the commands: ``report`` lists them and averages them nowhere,
``verify-equivariance checkpoint=`` and ``train resume=`` refuse them with one line, exit 2;
a full disk stops ``train`` with one line and the run resumes once there is space."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from symattn_cli.train.runfile import check_run_file, read_metrics, read_state, read_status
from tests.helpers import TINY_TRAIN, run_symattn, symattn_env
from tests.report.runfiles import write_run


def cut(path: Path, fraction: float) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    return path


def flip_summary(path: Path) -> Path:
    """Change one byte of the stored test accuracy (inside a checksummed object header)."""
    with h5py.File(path, "r") as h5:
        value = h5["summary/test_acc"][()].tobytes()
    data = bytearray(path.read_bytes())
    at = data.find(value)
    assert at > 0
    data[at + 6] ^= 0x01
    path.write_bytes(bytes(data))
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_report_lists_damaged_runs_and_averages_them_nowhere(symattn, workdir):
    sweep = workdir / "sweep"
    write_run(sweep / "0", seed=0, test_acc=0.6)
    write_run(sweep / "1", seed=1, test_acc=0.8)
    truncated = cut(write_run(sweep / "2", seed=2, test_acc=0.1), 0.5)
    flipped = flip_summary(write_run(sweep / "3", seed=3, test_acc=0.1))
    before = {path: digest(path) for path in (truncated, flipped)}
    result = symattn("report", "sweep", "plot=false", "hydra.run.dir=rep", cwd=workdir)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "2 finished runs in 1 group" in out and "2 not averaged" in out
    assert "70.00 ± 14.14" in out  # the two whole runs only
    lines = [line for line in out.splitlines() if "│ damaged" in line]
    assert len(lines) == 2
    assert "cut short" in lines[0] and "summary/test_acc" in lines[1]
    per_run = read_table_status(workdir / "rep" / "report.h5")
    assert per_run == ["finished", "finished", "damaged", "damaged"]
    assert {path: digest(path) for path in before} == before  # reading changed nothing


def read_table_status(path: Path) -> list[str]:
    from symattn_cli.train.runfile import read_table

    return list(read_table(path, "runs")["status"])


def test_report_of_a_damaged_file_named_on_its_own(symattn, workdir):
    damaged = cut(write_run(workdir / "run"), 0.7)
    result = symattn("report", str(damaged), "plot=false", "hydra.run.dir=rep", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "no finished run yet among the 1 found" in result.stdout
    assert "damaged" in result.stdout and "cut short" in result.stdout


@pytest.mark.parametrize(
    ("command", "damage"),
    [
        ("verify", "truncated"),
        ("resume", "flipped"),
        pytest.param("verify", "flipped", marks=pytest.mark.slow),
        pytest.param("resume", "truncated", marks=pytest.mark.slow),
    ],
)
def test_verify_and_resume_refuse_a_damaged_file(symattn, workdir, command, damage):
    path = write_run(workdir / "run", status="stopped")
    path = cut(path, 0.8) if damage == "truncated" else flip_summary(path)
    before = digest(path)
    if command == "verify":
        result = symattn("verify-equivariance", f"checkpoint={path.parent}",
                         "logger.mode=disabled", "hydra.run.dir=v", cwd=workdir)  # fmt: skip
    else:
        result = symattn("train", f"resume={path.parent}", cwd=workdir)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("symattn: error:"), lines
    assert f"{path} is damaged" in lines[0]
    assert ("cut short" if damage == "truncated" else "summary/test_acc") in lines[0]
    assert digest(path) == before


# ``symattn train`` whose run-file writes find no space from a chosen epoch on: every write
# into a state blob after the first ``FULL_AFTER`` states fails as a full disk fails.
FULL_DISK_TRAIN = """
import errno, os, sys
import h5py
FULL_AFTER = int(sys.argv.pop(1))
write = h5py.Dataset.__setitem__
states = []
def failing(self, key, value):
    if self.name.startswith("/state/blob"):
        states.append(self.name)
        if len(states) > FULL_AFTER:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write(self, key, value)
h5py.Dataset.__setitem__ = failing
from symattn_cli.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_full_disk_stops_training_with_one_line_and_resumes(workdir):
    run = workdir / "run"
    args = [*TINY_TRAIN, "trainer.epochs=3", "trainer.max_steps_per_epoch=3"]
    stopped = subprocess.run(
        [sys.executable, "-c", FULL_DISK_TRAIN, "2", "train", *args, f"hydra.run.dir={run}"],
        cwd=workdir, env=symattn_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert stopped.returncode == 2, stopped.stderr
    assert stopped.stderr.strip() == (
        f"symattn: error: no space left in {run} while writing the state of epoch 3; "
        f"{run / 'run.h5'} keeps epochs 1-2 and the state of epoch 2; free space, then "
        f"`symattn train resume={run}` continues from epoch 2"
    )
    path = run / "run.h5"
    assert check_run_file(path) == ""
    assert read_state(path)["epoch"] == 2 and read_status(path) == "running"
    resumed = run_symattn("train", f"resume={run}", cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    assert "after epoch 2" in resumed.stdout
    assert read_metrics(path)["epoch"].tolist() == [1.0, 2.0, 3.0]
    assert read_status(path) == "finished" and check_run_file(path) == ""
