"""A user's own model and data by Hydra's ``_target_``: built, refused with one line when wrong,
and never chosen by a file (a run file's ``_target_`` is imported only when the command line
names it too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from symattn_cli.configs.targets import TargetError, check_trusted, instantiate, shipped_targets
from symattn_cli.models.instantiate import build, build_model
from symattn_cli.train.runfile import RunFile
from tests.helpers import run_symattn

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MARKER = "payload-ran"


# -- errors: one line naming the target, the key and the fix --------------------------------


@pytest.mark.parametrize(
    ("node", "message"),
    [
        ({"_target_": "nopkg_missing.models.Net"}, r"no module 'nopkg_missing' .*pip install"),
        ({"_target_": "torch.nn.NoSuchLayer"}, r"torch.nn has no attribute 'NoSuchLayer'"),
        ({"_target_": "math.pi"}, r"math.pi is a float, not a class or function"),
        ({"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 3, "bogus": 1},
         r"model.bogus: torch.nn.Linear takes no argument 'bogus'; remove it"),
        ({"_target_": "torch.nn.Linear", "in_features": 2},
         r"model.out_features: torch.nn.Linear needs the argument 'out_features'; add"),
        ({"_target_": "torch.nn.Linear", "in_features": -2, "out_features": 3},
         r"model: torch.nn.Linear: "),
        ({"in_features": 2}, r"the model config has no _target_"),
        ({"_target_": "collections.OrderedDict"}, r"built a OrderedDict, not a torch.nn.Module"),
    ],
)  # fmt: skip
def test_a_target_that_cannot_be_built_is_one_line_naming_it(node, message):
    with pytest.raises(TargetError, match=message) as caught:
        build_model(OmegaConf.create(node))
    assert "\n" not in str(caught.value)


def test_a_module_that_fails_on_import_is_named(tmp_path, monkeypatch):
    (tmp_path / "broken_mod.py").write_text("raise RuntimeError('half written')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TargetError, match=r"importing it raised RuntimeError: half written"):
        instantiate({"_target_": "broken_mod.Net"}, "model")


def test_a_user_dataset_without_a_split_or_facts_is_refused(tmp_path, monkeypatch):
    (tmp_path / "userdata.py").write_text(
        "class NoVal:\n    train = test = [1]\n    val = None\n    num_classes = 2\n"
        "class NoClasses:\n    train = val = test = [1]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = {"model": {"_target_": "torch.nn.Identity"}, "data": {"_target_": "userdata.NoVal"}}
    with pytest.raises(TargetError, match=r"without the split 'val'"):
        build(OmegaConf.create(config))
    config["data"]["_target_"] = "userdata.NoClasses"
    with pytest.raises(TargetError, match=r"data.num_classes: userdata.NoClasses states no"):
        build(OmegaConf.create(config))


def test_the_example_builds_by_target_with_the_datas_facts(monkeypatch):
    """The example's model reads in_channels and num_classes from the example's dataset."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    config = OmegaConf.create({
        "model": yaml.safe_load((EXAMPLES / "conf/model/tiny_gsa.yaml").read_text()),
        "data": {**yaml.safe_load((EXAMPLES / "conf/data/tetrominoes.yaml").read_text()),
                 "num_train": 14, "num_val": 7, "num_test": 7},
    })  # fmt: skip
    data, model = build(config)
    assert (config.data.num_classes, config.data.in_channels, config.data.image_size) == (7, 1, 16)
    assert model.head.out_features == 7 and len(data.train) == 14
    x = data.test[0][0][None]
    assert model(x).shape == (1, 7)


# -- no file runs code ------------------------------------------------------------------------

CRAFTED = {
    "exec": {"_target_": "builtins.exec", "source": f"open({MARKER!r}, 'w').write('ran')"},
    "system": {"_target_": "os.system", "command": f"touch {MARKER}"},
    "import": {"_target_": "evil_on_import.Net"},
}
EVIL_MODULE = f"open({MARKER!r}, 'w').write('imported')\nclass Net:\n    pass\n"


def crafted_run(directory: Path, model: dict, data: dict | None = None) -> Path:
    """A finished run file whose stored config builds ``model`` (on rotmnist_mini)."""
    data = data or {"_target_": "symattn_cli.data.images.dataset", "name": "rotmnist_mini",
                    "root": "data"}  # fmt: skip
    config = {"model": model, "data": data,
              "trainer": {"epochs": 1}, "seed": 0}  # fmt: skip
    run = RunFile.create(
        directory / "run.h5", command="train", config_yaml=yaml.safe_dump(config),
        env={"git_commit": "", "git_dirty": False}, epoch_metrics=("epoch", "val_acc"),
        step_metrics=("step", "loss"), summary_metrics=("test_acc",), choices="",
    )  # fmt: skip
    run.append("epoch", {"epoch": 1, "val_acc": 0.5})
    run.set_summary({"test_acc": 0.5})
    run.set_status("finished")
    run.close()
    return run.path


@pytest.mark.parametrize("kind", CRAFTED)
def test_a_run_file_may_not_choose_the_code_that_runs(kind, tmp_path, monkeypatch):
    """In process: the stored targets are refused before anything is imported, both by
    resume= and by checkpoint=; the shipped targets are trusted."""
    from symattn_cli.commands.train import check_stored_targets, stored_config
    from symattn_cli.verify.checkpoint import load_trained

    (tmp_path / "evil_on_import.py").write_text(EVIL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    path = crafted_run(tmp_path, CRAFTED[kind])
    given = OmegaConf.create({"model": {"_target_": "symattn_cli.models.gsa_net.build"}})
    with pytest.raises(
        TargetError,
        match=rf"resume={path}: its config builds "
        rf"{CRAFTED[kind]['_target_']}, which neither",
    ):
        check_stored_targets(stored_config(path), given, path, "resume")
    with pytest.raises(TargetError, match="a run file may not choose the code that runs"):
        load_trained(path, tmp_path / "data")
    assert not (tmp_path / MARKER).exists()
    assert "symattn_cli.models.gsa_net.build" in shipped_targets()
    check_trusted({"model": CRAFTED[kind]}, {CRAFTED[kind]["_target_"]}, path, "resume")


@pytest.mark.slow
def test_the_commands_refuse_crafted_run_files_and_report_imports_nothing(tmp_path):
    """Through the program: resume= and checkpoint= exit 2 with one line; report lists the
    runs without importing their targets; no payload runs."""
    (tmp_path / "evil_on_import.py").write_text(EVIL_MODULE)
    runs = []
    for kind, model in CRAFTED.items():
        (tmp_path / kind).mkdir()
        runs.append(crafted_run(tmp_path / kind, model))
    for path in runs:
        for args in (("train", f"resume={path.parent}", "logger.mode=disabled"),
                     ("verify-equivariance", f"checkpoint={path.parent}",
                      "logger.mode=disabled")):  # fmt: skip
            result = run_symattn(*args, cwd=tmp_path)
            assert result.returncode == 2, result.stderr
            line = result.stderr.strip().splitlines()[-1]
            assert "a run file may not choose the code that runs" in line
    result = run_symattn("report", *(str(p.parent) for p in runs), "plot=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / MARKER).exists()


# -- the example package through the program -------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("native_attention_core")
def test_the_example_trains_verifies_benchmarks_and_reports(tmp_path):
    """The README's commands for a user's own model and data, run from the example folder:
    a few steps of training, its symmetry claim verified, its step timed beside a shipped
    model, the run reported."""
    import shutil

    work = tmp_path / "examples"
    shutil.copytree(EXAMPLES, work, ignore=shutil.ignore_patterns("outputs", "__pycache__"))
    conf = ["--config-dir", "conf", "model=tiny_gsa", "data=tetrominoes"]
    small = ["data.num_train=64", "data.num_val=16", "data.num_test=16"]
    trained = run_symattn("train", *conf, *small, "trainer.epochs=1", "trainer.progress=plain",
                          "logger.mode=disabled", cwd=work)  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    run = next((work / "outputs/train").glob("*/*/run.h5"))
    again = run_symattn("train", *conf, *small, "trainer.epochs=1", f"resume={run.parent}",
                        "trainer.progress=plain", "logger.mode=disabled", cwd=work)  # fmt: skip
    assert again.returncode == 0, again.stderr  # the user's config given again: trusted
    refused = run_symattn("train", f"resume={run.parent}", "logger.mode=disabled", cwd=work)
    assert refused.returncode == 2 and "may not choose the code" in refused.stderr
    verified = run_symattn("verify-equivariance", *conf, "groups=[r4,r8]", "claims=[r4]",
                           "logger.mode=disabled", "plot=false", cwd=work)  # fmt: skip
    assert verified.returncode == 0, verified.stderr
    assert "0 failed" in verified.stdout and "responded" in verified.stdout
    refused = run_symattn(
        "verify-equivariance",
        "--config-dir",
        "conf",
        "model=cnn_mini",
        "claims=[r4]",
        "groups=[r4]",
        "logger.mode=disabled",
        "plot=false",
        cwd=work,
    )  # a plain CNN claimed rotation invariant: the claim fails
    assert refused.returncode == 1 and "FAIL model z4 model (invariant)" in refused.stderr
    # the trained run: its user target is imported only when the command line names it
    untrusted = run_symattn("verify-equivariance", f"checkpoint={run.parent}",
                            "logger.mode=disabled", "plot=false", cwd=work)  # fmt: skip
    assert untrusted.returncode == 2
    assert "mypkg.data.Tetrominoes, mypkg.models.TinyGSANet, which neither" in untrusted.stderr
    trusted = run_symattn("verify-equivariance", *conf, f"checkpoint={run.parent}",
                          "logger.mode=disabled", "plot=false", cwd=work)  # fmt: skip
    # after a few steps a group layer may still hardly see its group axis (a FAIL, exit 1)
    assert trusted.returncode in (0, 1) and " checks, " in trusted.stdout, trusted.stderr
    timed = run_symattn("benchmark", "--config-dir", "conf", "preset=quick",
                        "models=[tiny_gsa,gsa_mini]", "repeats=1", "warmup=0",
                        "logger.mode=disabled", "plot=false", cwd=work)  # fmt: skip
    assert timed.returncode == 0, timed.stderr
    assert "tiny_gsa" in timed.stdout and "gsa_mini" in timed.stdout
    reported = run_symattn("report", str(run.parent), "plot=false", cwd=work)
    assert reported.returncode == 0, reported.stderr
    assert "test_acc" in reported.stdout


LEGACY_MODELS = {  # model configs as the program stored them before _target_
    "cnn": {"family": "cnn", "channels": [4, 8], "kernel_size": 3, "dropout": 0.1,
            "in_channels": 0, "num_classes": 0},
    "gsa": {"family": "gsa", "group": "r4", "arch": "auto", "channels": 8, "heads": 2,
            "patch_size": 3, "in_channels": 0, "num_classes": 0},
}  # fmt: skip


@pytest.mark.parametrize("family", LEGACY_MODELS)
def test_a_run_file_written_with_family_still_builds_its_model(family, tmp_path, monkeypatch):
    """Run files from before ``_target_`` stored ``family:``, sizes 0 (= from the data) and a
    data node without a target: read back, the family's target builds the model on the data's
    facts; a GSA-Net stored without ``group_index`` keeps ``relative``."""
    from symattn_cli.commands.train import check_stored_targets, stored_config

    monkeypatch.chdir(tmp_path)
    legacy_data = {"name": "rotmnist_mini", "kind": "image", "num_train": 32, "num_val": 8,
                   "num_test": 8, "arch": "rotmnist"}  # fmt: skip
    path = crafted_run(tmp_path, LEGACY_MODELS[family], legacy_data)
    stored = stored_config(path)
    assert "family" not in stored.model and stored.model._target_.startswith("symattn_cli.")
    check_stored_targets(stored, OmegaConf.create({}), path, "resume")  # shipped: trusted
    data, built = build(stored)
    assert (stored.data.num_classes, stored.data.in_channels) == (10, 1)
    assert built(data.test[0][0][None]).shape == (1, 10)
    if family == "gsa":
        assert stored.model.group_index == "relative"
