"""The package works as a built wheel, installed away from the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, symattn_env


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_checkout(tmp_path: Path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dist), str(REPO)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    wheel = next(dist.glob("symattn-*.whl"))
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         str(wheel)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    env = symattn_env()
    env["PYTHONPATH"] = str(target)  # the wheel, not the checkout
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(target / "bin" / "symattn"), *args],
            cwd=outside, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    where = subprocess.run(
        [sys.executable, "-c", "import symattn_cli.conf as c; print(c.__file__)"],
        cwd=outside, env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert where.startswith(str(target)), where
    assert (target / "symattn_cli" / "conf" / "train.yaml").is_file()
    gsa = target / "symattn_cli" / "nn" / "gsa"
    assert (gsa / "cpp_kernel.cpp").is_file()  # built on first use
    assert (gsa / "triton_kernel.py").is_file()  # Triton reads it

    help_ = run("--help")
    assert help_.returncode == 0 and "verify-equivariance" in help_.stdout
    job = run("train", "--cfg", "job", "model=cnn")
    assert job.returncode == 0, job.stderr
    assert "_target_: symattn_cli.models.cnn.build" in job.stdout
    tiny = run(
        "train", "model=cnn", "model.channels=[4]", "data.num_train=32", "data.num_val=16",
        "data.num_test=16", "trainer.epochs=1", "logger.mode=disabled",
    )  # fmt: skip
    assert tiny.returncode == 0, tiny.stderr
    assert "test_acc" in tiny.stdout
    assert list((outside / "outputs").rglob("run.h5")), os.listdir(outside)
    report = run("report", "outputs/train", "plot=false")
    assert report.returncode == 0, report.stderr
    assert "1 finished run in 1 group" in report.stdout
