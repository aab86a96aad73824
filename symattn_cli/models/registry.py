"""Model registry: config dict -> ``torch.nn.Module``, the same path for CLI and Python API.

A model config (``conf/model/<name>.yaml``) names its ``family``; each family has a module
with ``build(options: dict, spec: DataSpec) -> nn.Module`` that turns the options into the
constructor's keyword arguments. Nothing below this file reads a config object.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from symattn_cli.data.base import DataSpec
from symattn_cli.errors import ConfigError

FAMILY_MODULES = {
    "cnn": "symattn_cli.models.cnn",
    "gcnn": "symattn_cli.models.gcnn",
    "gsa": "symattn_cli.models.gsa_net",
    "ka": "symattn_cli.models.knowledge",
}
IMAGE_FAMILIES = ("cnn", "gcnn", "gsa")  # the rest (ka) read token sequences

# What create_model assumes when no data is given: each family's natural dataset.
DEFAULT_SPECS = {
    "image": DataSpec(
        task="classify", num_classes=10, in_channels=1, image_size=28, arch="rotmnist"
    ),
}


class ModelConfigError(ConfigError):
    """A model config names an unknown family or has an option of the wrong kind."""


def build_model(options: Mapping[str, Any], spec: DataSpec):
    """Build the model described by ``options`` (a resolved model config) for ``spec``."""
    options = dict(options)
    family = options.pop("family", None)
    if family not in FAMILY_MODULES:
        raise ModelConfigError(
            f"model family {family!r} is unknown; choose one of {sorted(FAMILY_MODULES)}"
        )
    if family in IMAGE_FAMILIES and spec.task != "classify":
        raise ModelConfigError(
            f"model family {family!r} classifies images; the data's task is {spec.task!r}: use "
            "an image dataset (data=rotmnist_mini, rotmnist, mnist, cifar10 or pcam), or a "
            "knowledge-attention model (model=ka_softmax, ...) for token sequences"
        )
    module = importlib.import_module(FAMILY_MODULES[family])
    return module.build(options, spec)


def stored_model_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """A model config as a run file stored it, with the values of options added since: a
    GSA-Net stored without ``group_index`` was built with the only index there was then,
    ``relative``."""
    options = dict(options)
    if options.get("family") == "gsa":
        options.setdefault("group_index", "relative")
    return options


def default_spec(family: str, options: Mapping[str, Any]) -> DataSpec:
    """The data a model is built for when :func:`create_model` is given none."""
    module = importlib.import_module(FAMILY_MODULES[family])
    if hasattr(module, "default_spec"):
        return module.default_spec(options)
    return DEFAULT_SPECS["image"]


def model_config(name: str, **overrides: Any) -> dict:
    """The resolved config of model ``name`` with ``overrides`` merged (type-checked)."""
    from omegaconf import OmegaConf

    from symattn_cli.configs.compose import compose_group

    cfg = compose_group("model", name)
    if overrides:
        cfg = OmegaConf.merge(cfg, overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def create_model(name: str, spec: DataSpec | None = None, **overrides: Any):
    """``symattn_cli.create_model``: build a registered model by name."""
    options = model_config(name, **overrides)
    if spec is None:
        spec = default_spec(options.get("family", ""), options)
    return build_model(options, spec)
