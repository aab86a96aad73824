"""Config groups, schemas and the Python model API."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

import symattn_cli
from symattn_cli.configs.paths import conf_dir, list_group_options


def test_config_groups_exist():
    for group in ("model", "data", "trainer", "logger", "experiment"):
        assert (conf_dir() / group).is_dir(), group
    assert "cnn" in list_group_options("model")
    assert "rotmnist_mini" in list_group_options("data")


def test_list_and_create_model():
    names = symattn_cli.list_models()
    assert "cnn" in names and not any(n.endswith("_schema") for n in names)
    model = symattn_cli.create_model("cnn", channels=[4, 8])
    assert sum(p.numel() for p in model.parameters()) > 0
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        symattn_cli.create_model("nope")


def test_unknown_name_lists_options(symattn, workdir):
    result = symattn("train", "model=nope", cwd=workdir)
    assert result.returncode != 0
    assert "Could not find 'model/nope'" in result.stderr
    assert "cnn" in result.stderr  # Hydra lists the available options
    assert "_schema" not in result.stderr  # internal schemas are not options


@pytest.mark.parametrize("group", ["model", "data", "trainer", "logger"])
def test_schemas_are_not_offered_as_options(group, symattn, workdir):
    """A wrong name lists the group's YAML options only, and so does ``--help``."""
    result = symattn("train", f"{group}=nope", cwd=workdir)
    assert result.returncode != 0 and f"Could not find '{group}/nope'" in result.stderr
    offered = result.stderr.split("Available options")[1].split("Config search path")[0]
    assert set(offered.split()[2:]) == set(list_group_options(group))  # after "in '<group>':"
    helped = symattn("train", "--help", cwd=workdir)
    groups = helped.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "_schema" not in groups


def test_wrong_type_is_one_line_error(symattn, workdir):
    result = symattn("train", "trainer.epochs=ten", cwd=workdir)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "trainer.epochs" in result.stderr and "ten" in result.stderr


def test_bad_value_is_one_line_error(symattn, workdir):
    result = symattn("train", "trainer.optimizer=adamx", "logger.mode=disabled", cwd=workdir)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "trainer.optimizer='adamx'" in result.stderr and "adamw" in result.stderr


def test_cfg_job_prints_composed_config(symattn, workdir):
    result = symattn("train", "--cfg", "job", "seed=3", cwd=workdir)
    assert result.returncode == 0, result.stderr
    cfg = OmegaConf.create(result.stdout)
    assert cfg.seed == 3 and cfg.logger.mode == "offline"  # W&B default: no account needed
    # the default run: the CPU-sized R4 GSA-Net on the bundled digits, every core
    assert (cfg.model._target_, cfg.model.group, cfg.model.heads) == (
        "symattn_cli.models.gsa_net.build",
        "r4",
        4,
    )
    assert cfg.model.norm == "batch" and cfg.model.attention_backend == "auto"
    assert cfg.data.name == "rotmnist_mini" and cfg.data.augment  # fresh angles per draw
    assert (cfg.trainer.threads, cfg.trainer.batch_size, cfg.trainer.lr) == (0, 16, 1e-2)


def test_upright_digits_with_default_augmentation_name_the_fix(symattn, workdir):
    """rotmnist_mini augments by default; asking for upright training digits says how to stop."""
    result = symattn("train", "data.variant=upright", "logger.mode=disabled", cwd=workdir)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "data.variant='upright'" in result.stderr and "data.augment=false" in result.stderr
