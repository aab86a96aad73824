"""Pieces shared by the image datasets: an in-memory dataset, rotation, splits, downloads.

Letters: N images, C channels, H×W pixels. Images are float32 ``(C, H, W)`` when served.
"""

from __future__ import annotations

import hashlib
import shutil
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from symattn_cli.data.base import DataError, DataSpec

# Variants of the MNIST-family datasets:
#   rotated  every split rotated by seeded uniform angles
#   upright  train and validation upright, test rotated (train-upright / test-rotated runs)
#   plain    nothing rotated
VARIANTS = ("rotated", "upright", "plain")

# Sub-streams of ``split_seed`` so the angles, the split and subsampling are independent.
SEED_STREAM_ANGLES = 1
SEED_STREAM_SPLIT = 2
SEED_STREAM_SUBSAMPLE = 3


class ImageTensorDataset(Dataset):
    """Images held in memory, served as ``(x float32 (C, H, W), y int)``.

    ``images`` is ``(N, C, H, W)``, either uint8 (scaled by 1/255 on the way out, which keeps
    CIFAR-sized sets at a quarter of the memory) or float32 (served as is). ``mean``/``std``
    (per channel) normalise after scaling; ``augment`` maps one float image to another (and,
    with a ``many`` method, a batch of them) and is applied last (training split only).
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        *,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if images.ndim != 4:
            raise ValueError(f"images must be (N, C, H, W), got shape {tuple(images.shape)}")
        if labels.shape != (images.shape[0],):
            raise ValueError(
                f"labels must be ({images.shape[0]},) to match the images, "
                f"got {tuple(labels.shape)}"
            )
        self.images = images
        self.labels = labels.long()
        channels = images.shape[1]
        self._mean = None if mean is None else torch.tensor(mean).view(channels, 1, 1)
        self._std = None if std is None else torch.tensor(std).view(channels, 1, 1)
        self.augment = augment

    def __len__(self) -> int:
        return self.images.shape[0]

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        """Stored images ``(..., C, H, W)`` as float32, scaled and normalised."""
        x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
        if self._mean is not None:
            x = (x - self._mean) / self._std
        return x

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x = self._scaled(self.images[index])  # (C, H, W)
        if self.augment is not None:
            x = self.augment(x)
        return x, int(self.labels[index])

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, int]]:
        """``[self[i] for i in indices]`` in one pass over the batch (the DataLoader's batched
        fetch): one scaling and normalisation, and one call of ``augment.many`` on the ``(N,
        C, H, W)`` images where the augmentation has it (the same draws, in the same order, as
        one call per image)."""
        index = torch.as_tensor(list(indices), dtype=torch.long)
        x = self._scaled(self.images[index])  # (N, C, H, W)
        if self.augment is not None:
            many = getattr(self.augment, "many", None)
            x = many(x) if many is not None else torch.stack([self.augment(one) for one in x])
        return list(zip(x.unbind(0), self.labels[index].tolist(), strict=True))


@dataclass(frozen=True)
class GridAugmentation:
    """Random training transformations of one image ``(C, H, W)``, in this order: a shift by
    up to ``shift`` pixels each way (zero fill), a left-right flip (x -> -x, the columns
    reversed) with probability 1/2 when ``flip``, a turn by a random multiple of 90 degrees
    when ``quarter_turns``.

    :meth:`pixel_exact` names the flips and turns among these, which map the pixel grid onto
    itself: a model meant for the data should be exactly invariant to each of them (the
    tests hold every preset to it).
    """

    shift: int = 0
    flip: bool = False
    quarter_turns: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.shift:
            _, h, w = x.shape
            p = self.shift
            padded = F.pad(x, (p, p, p, p))  # (C, H + 2p, W + 2p)
            top, left = torch.randint(0, 2 * p + 1, (2,)).tolist()
            x = padded[:, top : top + h, left : left + w]  # (C, H, W)
        turns = int(torch.randint(0, 4, ())) if self.quarter_turns else 0
        if self.flip and torch.rand(()) < 0.5:
            x = x.flip(-1)
        if turns:
            x = torch.rot90(x, turns, dims=(-2, -1))  # counter-clockwise as displayed
        return x.contiguous()

    def pixel_exact(self) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """The generators of the flips and turns this augmentation draws from, by name."""
        out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        if self.flip:
            out["left-right flip"] = _flip_left_right
        if self.quarter_turns:
            out["quarter turn"] = _quarter_turn
        return out


def _flip_left_right(x: torch.Tensor) -> torch.Tensor:
    return x.flip(-1)


def _quarter_turn(x: torch.Tensor) -> torch.Tensor:
    return torch.rot90(x, 1, dims=(-2, -1))


def generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator for one independent use (``stream``) of ``split_seed``."""
    g = torch.Generator()
    g.manual_seed(int(seed) * 1000 + stream)
    return g


def uniform_angles(n: int, seed: int) -> torch.Tensor:
    """``n`` angles in degrees, uniform on [0, 360), fixed by ``seed``. ``(n,)`` float64."""
    return torch.rand(n, generator=generator(seed, SEED_STREAM_ANGLES), dtype=torch.float64) * 360


def rotate(images: torch.Tensor, angles_deg: torch.Tensor, batch: int = 2048) -> torch.Tensor:
    """Rotate each image counter-clockwise (as displayed) about its centre, bilinearly.

    ``images`` ``(N, C, H, W)`` float (or uint8, scaled to [0, 1]), ``angles_deg`` ``(N,)``.
    Pixels coming from outside the frame are 0. Multiples of 90° are exact (they map pixel
    centres onto pixel centres). Returns float32 ``(N, C, H, W)``.
    """
    if images.ndim != 4 or images.shape[-1] != images.shape[-2]:
        raise ValueError(f"rotate needs square (N, C, H, W) images, got {tuple(images.shape)}")
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    out = torch.empty_like(x)
    theta_rad = torch.deg2rad(angles_deg.to(torch.float64))
    cos, sin = torch.cos(theta_rad), torch.sin(theta_rad)
    # affine_grid maps each output pixel (x right, y down, in [-1, 1]) to where it is read in
    # the input: the inverse of the counter-clockwise display rotation, [[c, -s], [s, c]].
    theta = torch.zeros(len(angles_deg), 2, 3, dtype=torch.float64)  # (N, 2, 3)
    theta[:, 0, 0], theta[:, 0, 1] = cos, -sin
    theta[:, 1, 0], theta[:, 1, 1] = sin, cos
    for start in range(0, x.shape[0], batch):
        chunk = x[start : start + batch]  # (b, C, H, W)
        grid = F.affine_grid(
            theta[start : start + batch].float(), list(chunk.shape), align_corners=False
        )  # (b, H, W, 2)
        out[start : start + batch] = F.grid_sample(
            chunk, grid, mode="bilinear", padding_mode="zeros", align_corners=False
        )
    return out


def subsample(
    dataset_size: int, requested: int, seed: int, split: str, option: str
) -> torch.Tensor | None:
    """Indices of a deterministic random subset of ``requested`` items, or None for all.

    ``requested`` = 0 keeps the whole split. More than the split holds is an error naming
    the option and the largest valid value.
    """
    if requested < 0:
        raise DataError(f"{option}={requested} is negative; use 0 for the full split or a count")
    if requested == 0 or requested == dataset_size:
        return None
    if requested > dataset_size:
        raise DataError(
            f"{option}={requested} asks for more than the {split} split holds "
            f"({dataset_size}); use at most {dataset_size}, or 0 for all"
        )
    offset = {"train": 0, "val": 1, "test": 2}[split]
    g = generator(seed * 3 + offset, SEED_STREAM_SUBSAMPLE)
    return torch.randperm(dataset_size, generator=g)[:requested].sort().values


def classify_spec(
    options: Mapping[str, Any], classes: int, channels: int, size: int, arch: str
) -> DataSpec:
    """The DataSpec of an image classification dataset; ``data.arch`` overrides ``arch``."""
    return DataSpec(
        task="classify",
        num_classes=classes,
        in_channels=channels,
        image_size=size,
        arch=option(options, "arch", "") or arch,
    )


def option(options: Mapping[str, Any], key: str, default: Any) -> Any:
    """``options[key]``, or ``default`` when missing or None."""
    value = options.get(key)
    return default if value is None else value


def int_option(options: Mapping[str, Any], key: str) -> int:
    value = option(options, key, 0)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DataError(f"data.{key}={value!r} is not an integer") from None


def check_variant(name: str, options: Mapping[str, Any], allowed: Sequence[str], default: str):
    variant = option(options, "variant", default)
    if variant not in allowed:
        raise DataError(
            f"data.variant={variant!r} is not available for dataset {name!r}; "
            f"choose one of {list(allowed)}"
        )
    return variant


def md5_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


# Errors that mean "the network (or the server, or the disk) failed": URLError, HTTPError,
# socket timeouts and refused connections are all OSErrors. Callers catch these and raise one
# DataError line, so no downloader traceback reaches the user.
NETWORK_ERRORS = (OSError,)


def download(url: str, dest: Path, timeout: float = 30.0) -> None:
    """Fetch ``url`` to ``dest`` (written as ``dest.part`` first, renamed when complete).

    Raises the underlying network error; callers turn it into a :class:`DataError`.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(part, "wb") as out:
            shutil.copyfileobj(response, out)
        part.replace(dest)
    finally:
        part.unlink(missing_ok=True)


def missing_files_error(
    dataset: str, files: Sequence[str], folder: Path, why: str, how_to_get: str
) -> DataError:
    """One message naming the dataset, the files expected, the folder and the fix."""
    return DataError(
        f"dataset {dataset!r} is not available ({why}): expected {', '.join(files)} in "
        f"{folder}. {how_to_get}"
    )
