"""Typed configs of the image datasets (``conf/data/*.yaml`` extend these).

A data config also states the facts about its data that a model is sized by; model configs
read them by interpolation (``num_classes: ${data.num_classes}``). Image data:
``num_classes``, ``in_channels``, ``image_size`` (the side of its square images) and ``arch``
(the GSA-Net preset it suggests); sequence data: see :mod:`symattn_cli.configs.sequences`.
A value left ``null`` is filled in from the dataset once it is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# How a model config reads the data's facts (the defaults of the model schemas).
DATA_NUM_CLASSES = "${data.num_classes}"
DATA_IN_CHANNELS = "${data.in_channels}"
DATA_IMAGE_SIZE = "${oc.select:data.image_size,0}"  # 0: not known, not checked
DATA_ARCH = "${oc.select:data.arch,auto}"  # auto: the rotmnist preset


@dataclass
class ImageDataConfig:
    _target_: str = "symattn_cli.data.images.dataset"
    name: str = "rotmnist_mini"
    root: str = "${data_root}"  # dataset files; relative paths resolve against the launch dir
    task: str = "classify"
    num_classes: int | None = None
    in_channels: int | None = None
    image_size: int | None = None
    kind: str = "image"
    # rotmnist_mini/mnist: rotated | upright (train+val upright, test rotated) | plain;
    # rotmnist: rotated (already rotated by its authors); cifar10/pcam: plain
    variant: str = "rotated"
    download: bool = True  # try to download when files are missing (needs network)
    verify_md5: bool = True  # rotmnist: check the zip against its known md5
    num_train: int = 0  # 0 = the dataset's standard split size
    num_val: int = 0
    num_test: int = 0
    split_seed: int = 0  # fixes rotation angles and the train/validation/test split
    augment: bool = False
    arch: str = ""  # architecture preset this dataset suggests (rotmnist | cifar10 | pcam)


SCHEMAS: list[tuple[str | None, str, Any]] = [
    (None, "image_schema", ImageDataConfig),
]
