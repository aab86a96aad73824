"""Where the Hydra configs live, found the same way from a checkout and from a wheel."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

CONFIG_MODULE = "symattn_cli.conf"
SCHEMA_SUFFIX = "_schema"


def conf_dir() -> Path:
    """The folder holding ``train.yaml`` and the config groups (``model/``, ``data/``, ...)."""
    return Path(str(importlib.resources.files(CONFIG_MODULE)))


def list_group_options(group: str) -> list[str]:
    """Names selectable as ``<group>=<name>``: the YAML files of a group (schemas excluded)."""
    folder = conf_dir() / group
    return sorted(
        p.stem
        for p in folder.glob("*.yaml")
        if not p.stem.endswith(SCHEMA_SUFFIX) and not p.stem.startswith("_")
    )
