"""``symattn verify-equivariance``: reduced runs, HDF5 contents, exit status, checkpoints."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from symattn_cli.train.runfile import read_summary, read_table
from tests.helpers import TINY_TRAIN, call_symattn, run_symattn, symattn_env


def test_reduced_run_writes_table_and_plot(symattn, workdir):
    out = workdir / "v"
    result = symattn(
        "verify-equivariance", "groups=[r4,z2m]", "families=[gsa,attention]",
        "logger.mode=disabled", f"hydra.run.dir={out}", cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "0 failed" in result.stdout and "negative controls failed as expected" in result.stdout
    table = read_table(out / "verify.h5", "checks")
    exact = table["expect"] == "exact"
    assert exact.sum() > 20
    assert np.all(table["rel_err"][exact] <= 1e-10)
    assert set(table["verdict"][exact]) == {"pass"}
    controls = table["expect"] == "violation"
    assert controls.sum() >= 2 and np.all(table["rel_err"][controls] > 1e-3)
    # every element of R4 appears for the group layer, for each group index
    r4 = table["symmetry"] == "z4"
    for index in ("pair", "gevit", "relative"):
        group_rows = table["layer"] == f"group (Eq. 16, sum, {index})"
        assert {"rot0", "rot90", "rot180", "rot270"} <= set(table["element"][group_rows & r4])
    # non-degeneracy: the exact, non-blind indices see the group axis; relative in the sum
    # form (and the reference's index) is reported as blind
    responds = table["expect"] == "responds"
    assert responds.sum() > 20 and np.all(table["rel_err"][responds] >= 1e-6)
    blind = table["expect"] == "blind"
    assert np.all(table["rel_err"][blind] <= 1e-10)
    blind_layers = set(table["layer"][blind])
    assert "group (Eq. 16, sum, relative) · group axis alone" in blind_layers
    assert "group (Eq. 16, sum, pair) · group axis alone" in set(table["layer"][responds])
    assert not any("pair" in layer or "gevit" in layer for layer in blind_layers)
    assert "non-degeneracy checks responded" in result.stdout
    assert read_summary(out / "verify.h5")["failures"] == 0
    assert (out / "errors.png").stat().st_size > 0


def test_float32_floor_is_visible(symattn, workdir):
    out = workdir / "v32"
    result = symattn(
        "verify-equivariance", "groups=[z4]", "layers=[lifting]", "families=[gsa]",
        "dtype=float32", "offgrid=false", "plot=false", "logger.mode=disabled",
        f"hydra.run.dir={out}", cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    table = read_table(out / "verify.h5", "checks")
    grid = table["layer"] == "lifting"
    assert np.all(table["rel_err"][grid] < 1e-4)
    assert np.any(table["rel_err"][grid] > 1e-12)  # float32 round-off, not float64's


FAILING = """
import sys
import symattn_cli.verify.suite as suite
from symattn_cli.verify.records import Check
suite.run_suite = lambda **kw: [Check("gsa", "r4", "lifting", "rot90", 1e-3, 1e-3)]
from symattn_cli.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_failing_exact_check_exits_non_zero(workdir):
    result = subprocess.run(
        [sys.executable, "-c", FAILING, "verify-equivariance", "plot=false",
         "logger.mode=disabled", f"hydra.run.dir={workdir / 'f'}"],
        cwd=workdir, env=symattn_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert "FAIL gsa r4 lifting rot90" in result.stderr
    assert (workdir / "f" / "verify.h5").exists()  # the evidence is still written


def test_a_failing_exact_check_exits_non_zero_in_process(workdir, monkeypatch):
    """The check above by the dispatcher in this process, for the quick loop."""
    import symattn_cli.verify.suite as suite
    from symattn_cli.verify.records import Check

    failing = [Check("gsa", "r4", "lifting", "rot90", 1e-3, 1e-3)]
    monkeypatch.setattr(suite, "run_suite", lambda **kw: failing)
    result = call_symattn("verify-equivariance", "plot=false", "logger.mode=disabled",
                          f"hydra.run.dir={workdir / 'f'}", cwd=workdir)  # fmt: skip
    assert result.returncode == 1
    assert "FAIL gsa r4 lifting rot90" in result.stderr
    assert (workdir / "f" / "verify.h5").exists()


def test_unknown_layer_is_a_clear_error(symattn, workdir):
    result = symattn("verify-equivariance", "layers=[attn]", "logger.mode=disabled",
                     cwd=workdir)  # fmt: skip
    assert result.returncode == 2 and "layers: 'attn' is unknown" in result.stderr


def test_unknown_group_and_too_few_images_are_clear_errors(symattn, workdir):
    result = symattn("verify-equivariance", "groups=[r9]", "logger.mode=disabled",
                     cwd=workdir)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "groups: unknown group 'r9'; choose one of: z2, z4, r8" in result.stderr
    result = symattn("verify-equivariance", "checkpoint=run.h5", "checkpoint_images=0",
                     "logger.mode=disabled", cwd=workdir)  # fmt: skip
    assert result.returncode == 2 and "checkpoint_images=0 must be at least 1" in result.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("native_attention_core")
def test_checkpoint_of_a_trained_gsa_model(workdir):
    run = workdir / "gsa"
    args = [a for a in TINY_TRAIN if not a.startswith("model")]
    trained = run_symattn("train", *args, "model=gsa_mini", "model.channels=8", "model.heads=2",
                          "trainer.epochs=1", "trainer.max_steps_per_epoch=4",
                          f"hydra.run.dir={run}", cwd=workdir)  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    # training drew the attention over the group at the tested weights too
    assert f"attention maps: {run / 'attention.png'}" in trained.stdout
    out = workdir / "check"
    result = run_symattn("verify-equivariance", f"checkpoint={run}", "checkpoint_images=64",
                         "logger.mode=disabled", f"hydra.run.dir={out}", cwd=workdir)  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    table = read_table(out / "verify.h5", "checks")
    agreement = table["layer"] == "same prediction on test digits"
    exact = agreement & (table["expect"] == "exact")
    assert exact.sum() == 4 and np.all(table["rel_err"][exact] == 0.0)  # 100% unchanged
    assert np.any(agreement & (table["expect"] == "approximate"))  # 45°, 30° measured
    trained_rows = np.char.startswith(table["layer"].astype(str), "trained ")
    layers = trained_rows & (table["expect"] == "exact")
    assert layers.sum() > 4 and np.all(table["rel_err"][layers] <= 1e-10)
    # and every trained group layer sees its group axis (the default index is not blind)
    sees = trained_rows & (table["expect"] == "responds")
    assert sees.sum() >= 2 and np.all(table["rel_err"][sees] >= 1e-6)
    assert not np.any(trained_rows & (table["expect"] == "blind"))
    assert f"attention maps: {out / 'attention.png'}" in result.stdout
    assert (out / "attention.png").stat().st_size > 10_000


@pytest.mark.slow
def test_checkpoint_of_a_trained_knowledge_model(workdir):
    run = workdir / "ka"
    trained = run_symattn(
        "train", "model=ka_softmax", "data=arithmetic", "model.d_model=16", "model.heads=2",
        "model.layers=1", "model.mlp_hidden=32", "trainer.epochs=1", "trainer.lr=3e-3",
        "trainer.max_steps_per_epoch=150", "trainer.threads=1", "logger.mode=disabled",
        "trainer.progress=plain", f"hydra.run.dir={run}", cwd=workdir,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    out = workdir / "check"
    result = run_symattn("verify-equivariance", f"checkpoint={run}", "logger.mode=disabled",
                         f"hydra.run.dir={out}", cwd=workdir)  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    table = read_table(out / "verify.h5", "checks")
    assert not (out / "attention.png").exists()  # no lifting layer to show
    rows = dict(zip(table["layer"].tolist(), table["rel_err"].tolist(), strict=True))
    assert rows["embedding + knowledge rotated"] <= 1e-10  # logits unchanged
    assert rows["same prediction on test split"] == 0.0  # 100% of predictions unchanged
    assert rows["embedding rotated alone: token acc drop"] > 0.1
