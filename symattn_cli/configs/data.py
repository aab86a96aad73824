"""Typed configs of the image datasets (``conf/data/*.yaml`` extend these)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ImageDataConfig:
    name: str = "rotmnist_mini"
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
