"""Dataset registry: a data config (dict) -> :class:`~symattn_cli.data.base.DataBundle`."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from symattn_cli.data.base import DataBundle, DataError

DATASET_MODULES = {
    "rotmnist": "symattn_cli.data.images",
    "rotmnist_mini": "symattn_cli.data.images",
    "mnist": "symattn_cli.data.images",
    "cifar10": "symattn_cli.data.images",
    "pcam": "symattn_cli.data.images",
    "arithmetic": "symattn_cli.data.sequences",
    "addition": "symattn_cli.data.sequences",
    "sort": "symattn_cli.data.sequences",
    "reverse": "symattn_cli.data.sequences",
}


def build_data(options: Mapping[str, Any], root: Path) -> DataBundle:
    """Load or generate the dataset ``options["name"]``, caching files under ``root``.

    Each dataset module exposes ``build(name: str, options: dict, root: Path) -> DataBundle``.
    """
    options = dict(options)
    name = options.get("name")
    if name not in DATASET_MODULES:
        raise DataError(f"dataset {name!r} is unknown; choose one of {sorted(DATASET_MODULES)}")
    module = importlib.import_module(DATASET_MODULES[name])
    return module.build(name, options, Path(root))
