"""The config boundary: structured schemas registered with Hydra, and name registries.

This package holds the types (one dataclass per config node); the YAML values that extend
them live in ``conf/`` (the package ``symattn_cli.conf``).

Each module here lists ``SCHEMAS`` as ``(group, name, dataclass)``; a YAML file in ``conf/``
extends a schema through its defaults list, so Hydra type-checks every override. Schemas are
stored at the root (group ``None``), outside the selectable groups, and a group's YAML pulls
its schema in with an absolute entry (``- /cnn_schema@_here_`` in ``model/cnn.yaml``): Hydra
then never offers a schema as a ``model=`` / ``data=`` / ... option.
"""

from __future__ import annotations

import importlib

SCHEMA_MODULES = ("base", "data", "sequences", "cnn", "gsa", "knowledge")


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for module_name in SCHEMA_MODULES:
        module = importlib.import_module(f"symattn_cli.configs.{module_name}")
        for group, name, node in module.SCHEMAS:
            store.store(group=group, name=name, node=node)
