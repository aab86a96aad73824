"""``mnist``, ``cifar10`` and ``pcam``: the standard files, in torchvision's folder layout.

=========  ==============================================  ================================
dataset    files (under the data root)                     reader
=========  ==============================================  ================================
mnist      ``MNIST/raw/{train,t10k}-images-idx3-ubyte``    torchvision ``MNIST`` (checks
           ``MNIST/raw/{train,t10k}-labels-idx1-ubyte``    only that the files exist)
cifar10    ``cifar-10-batches-py/data_batch_{1..5}``,      own restricted pickle reader
           ``.../test_batch``
pcam       ``pcam/camelyonpatch_level_2_split_{train,``    own lazy h5py reader (below)
           ``valid,test}_{x,y}.h5``
=========  ==============================================  ================================

CIFAR-10: torchvision's ``CIFAR10`` refuses any batch file whose md5 differs from the
original's, so it cannot read small files of the same format; this module reads the pickle
batches itself and checks the same md5 sums (taken from torchvision's class) only when
``verify_md5`` is on. Its unpickler admits only the types a batch holds (numpy arrays and
dtypes, besides pickle's own dicts, lists, strings and numbers), so a crafted file in
``data/`` is refused instead of running code. PCam: torchvision's ``PCAM`` reopens both HDF5
files for every item; this module keeps one handle per process and reads images lazily (the
training images are 7 GB as uint8). Downloads go through torchvision; any failure becomes one
DataError line.

Splits: MNIST and CIFAR-10 hold out a seeded 1/12 resp. 1/10 of their training files for
validation (5,000 images each); PCam has its own validation files.
"""

from __future__ import annotations

import copy
import os
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from symattn_cli.data.base import DataBundle, DataError, DataSpec
from symattn_cli.data.image_common import (
    SEED_STREAM_SPLIT,
    VARIANTS,
    GridAugmentation,
    ImageTensorDataset,
    check_variant,
    classify_spec,
    generator,
    int_option,
    md5_of,
    missing_files_error,
    option,
    rotate,
    subsample,
    uniform_angles,
)

# Errors torchvision's downloaders raise when the network, the server or the checksum fails
# (URLError is an OSError; gdown missing and md5 mismatches are RuntimeErrors).
DOWNLOAD_ERRORS = (OSError, RuntimeError, ImportError)

MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
MNIST_VAL_DIVISOR = 12  # 60,000 -> 55,000 train + 5,000 validation

CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST_FILES = ("test_batch",)
CIFAR_VAL_DIVISOR = 10  # 50,000 -> 45,000 train + 5,000 validation
# Per-channel mean and standard deviation of the CIFAR-10 training images (in [0, 1]).
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)

PCAM_FOLDER = "pcam"
PCAM_SPLITS = {"train": "train", "val": "valid", "test": "test"}

# classes, channels, image side and architecture preset of each dataset
SHAPES = {
    "mnist": (10, 1, 28, "rotmnist"),
    "cifar10": (10, 3, 32, "cifar10"),
    "pcam": (2, 3, 96, "pcam"),
}
# data.augment=true: CIFAR-10 the usual shift by up to 4 pixels and left-right flip; PCam
# every flip and quarter turn (histology has no upright).
AUGMENTATIONS = {
    "cifar10": GridAugmentation(shift=4, flip=True),
    "pcam": GridAugmentation(flip=True, quarter_turns=True),
}


def spec(name: str, options: Mapping[str, Any]) -> DataSpec:
    """The DataSpec of dataset ``name``, known without reading its files."""
    return classify_spec(options, *SHAPES[name])


def augmentation(name: str, options: Mapping[str, Any]) -> GridAugmentation | None:
    """The training augmentation of ``name`` when ``data.augment`` is on, else None."""
    return AUGMENTATIONS.get(name) if option(options, "augment", False) else None


def training_symmetries(name: str, options: Mapping[str, Any]) -> dict[str, Callable]:
    """The pixel-exact flips and turns the training images of ``name`` go through."""
    augment = augmentation(name, options)
    return {} if augment is None else augment.pixel_exact()


def _pcam_files(split: str) -> tuple[str, str]:
    stem = f"camelyonpatch_level_2_split_{PCAM_SPLITS[split]}"
    return f"{stem}_x.h5", f"{stem}_y.h5"


def _holdout(n: int, divisor: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded train / validation indices of a training file of ``n`` images."""
    order = torch.randperm(n, generator=generator(seed, SEED_STREAM_SPLIT))
    n_val = n // divisor
    return order[n_val:].sort().values, order[:n_val].sort().values


def _take(indices: torch.Tensor, options: Mapping[str, Any], split: str, seed: int):
    requested = int_option(options, f"num_{split}")
    keep = subsample(len(indices), requested, seed, split, f"data.num_{split}")
    return indices if keep is None else indices[keep]


# --- MNIST ------------------------------------------------------------------------------------


def _mnist_missing(root: Path, why: str) -> DataError:
    return missing_files_error(
        "mnist",
        MNIST_FILES,
        root / "MNIST" / "raw",
        why,
        "Put the four (unzipped) idx files there, or run with data.download=true (the "
        "default) on a machine with network; data=rotmnist_mini works offline.",
    )


def _read_mnist(root: Path, download: bool):
    from torchvision.datasets import MNIST

    raw = root / "MNIST" / "raw"
    if not all((raw / name).is_file() for name in MNIST_FILES):
        if not download:
            raise _mnist_missing(root, "files not found and data.download=false")
        try:
            MNIST(str(root), train=True, download=True)
        except DOWNLOAD_ERRORS as err:
            raise _mnist_missing(root, f"download failed: {_one_line(err)}") from None
    try:
        train = MNIST(str(root), train=True, download=False)
        test = MNIST(str(root), train=False, download=False)
    except (RuntimeError, AssertionError, TypeError, ValueError) as err:
        # torchvision's idx parser asserts on a bad header
        raise DataError(
            f"the MNIST idx files in {raw} could not be read ({_one_line(err) or 'bad header'});"
            f" replace them with the original files {', '.join(MNIST_FILES)}"
        ) from None
    return train.data, train.targets, test.data, test.targets  # uint8 (N, 28, 28), int64 (N,)


def build_mnist(name: str, options: Mapping[str, Any], root: Path) -> DataBundle:
    variant = check_variant(name, options, VARIANTS, default="upright")
    seed = int_option(options, "split_seed")
    train_x, train_y, test_x, test_y = _read_mnist(root, bool(option(options, "download", True)))
    # One seeded angle per image of both files (training file first).
    angles = uniform_angles(len(train_y) + len(test_y), seed)
    train_angles, test_angles = angles[: len(train_y)], angles[len(train_y) :]
    train_idx, val_idx = _holdout(len(train_y), MNIST_VAL_DIVISOR, seed)
    test_idx = torch.arange(len(test_y))
    rotated_splits = {"rotated": ("train", "val", "test"), "upright": ("test",), "plain": ()}

    datasets = {}
    for split, (images, labels, all_angles, indices) in {
        "train": (train_x, train_y, train_angles, train_idx),
        "val": (train_x, train_y, train_angles, val_idx),
        "test": (test_x, test_y, test_angles, test_idx),
    }.items():
        indices = _take(indices, options, split, seed)
        x = images[indices].unsqueeze(1).float() / 255.0  # (n, 1, 28, 28)
        if split in rotated_splits[variant]:
            x = rotate(x, all_angles[indices]).clamp_(0.0, 1.0)
        datasets[split] = ImageTensorDataset(x, labels[indices])
    return DataBundle(
        train=datasets["train"],
        val=datasets["val"],
        test=datasets["test"],
        spec=spec(name, options),
    )


# --- CIFAR-10 ---------------------------------------------------------------------------------


def _cifar_missing(root: Path, why: str) -> DataError:
    return missing_files_error(
        "cifar10",
        CIFAR_TRAIN_FILES + CIFAR_TEST_FILES,
        root / CIFAR_FOLDER,
        why,
        "Unpack cifar-10-python.tar.gz (https://www.cs.toronto.edu/~kriz/cifar.html) in "
        f"{root}, or run with data.download=true (the default) on a machine with network.",
    )


# The only globals a CIFAR-10 batch refers to: numpy's array reconstruction (under numpy 1's
# and numpy 2's module names; _frombuffer for pickle protocol 5), ndarray and dtype; and, in
# batches re-pickled by Python 3 with protocol 2, _codecs.encode for bytes (as latin-1 text).
CIFAR_PICKLE_GLOBALS = frozenset(
    [(f"numpy.{core}.multiarray", "_reconstruct") for core in ("core", "_core")]
    + [(f"numpy.{core}.numeric", "_frombuffer") for core in ("core", "_core")]
    + [("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")]
)


def _latin1_bytes(text: str, encoding: str = "utf-8") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it, for latin-1 text only."""
    if not isinstance(text, str) or encoding.replace("-", "").lower() != "latin1":
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r} is not a batch's bytes")
    return text.encode("latin-1")


class _CifarUnpickler(pickle.Unpickler):
    """An unpickler that builds nothing but pickle's plain types and numpy arrays: every
    callable a pickle can name goes through :meth:`find_class`, which admits only
    :data:`CIFAR_PICKLE_GLOBALS`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in CIFAR_PICKLE_GLOBALS:
            raise pickle.UnpicklingError(
                f"it refers to {module}.{name}, which no CIFAR-10 batch holds"
            )
        if (module, name) == ("_codecs", "encode"):
            return _latin1_bytes
        return super().find_class(module, name)


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch: uint8 images ``(n, 3, 32, 32)``, int64 labels ``(n,)``.

    The batch is a pickled dict with ``data`` (n × 3072 uint8, channel planes R, G, B, each
    32×32 row-major) and ``labels`` (n ints), read by :class:`_CifarUnpickler`: a file that
    names any other type raises :class:`DataError` before anything of it runs.
    """
    try:
        with open(path, "rb") as f:
            entry = _CifarUnpickler(f, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
        raise DataError(f"{path} is not a CIFAR-10 python batch ({err}); replace it") from None
    if not isinstance(entry, dict) or "data" not in entry or "labels" not in entry:
        raise DataError(f"{path} is not a CIFAR-10 python batch (no data/labels); replace it")
    data = np.asarray(entry["data"])
    labels = np.asarray(entry["labels"], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(
            f"{path}: data is {data.dtype} {data.shape}, expected uint8 (n, 3072); replace it"
        )
    if labels.shape != (data.shape[0],) or labels.min(initial=0) < 0 or labels.max(initial=0) > 9:
        raise DataError(f"{path}: labels are not {data.shape[0]} classes 0–9; replace it")
    return data.reshape(-1, 3, 32, 32), labels


def _check_cifar_md5(folder: Path) -> None:
    from torchvision.datasets import CIFAR10

    for file_name, expected in CIFAR10.train_list + CIFAR10.test_list:
        actual = md5_of(folder / file_name)
        if actual != expected:
            raise DataError(
                f"{folder / file_name} has md5 {actual}, expected {expected} (the original "
                f"CIFAR-10 batch): delete {folder} to download it again, or set "
                f"data.verify_md5=false to use these files anyway"
            )


def _read_cifar(root: Path, download: bool, verify_md5: bool):
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import download_and_extract_archive

    folder = root / CIFAR_FOLDER
    names = CIFAR_TRAIN_FILES + CIFAR_TEST_FILES
    if not all((folder / name).is_file() for name in names):
        if not download:
            raise _cifar_missing(root, "files not found and data.download=false")
        try:
            download_and_extract_archive(
                CIFAR10.url, str(root), filename=CIFAR10.filename, md5=CIFAR10.tgz_md5
            )
        except DOWNLOAD_ERRORS as err:
            raise _cifar_missing(root, f"download failed: {_one_line(err)}") from None
    if verify_md5:
        _check_cifar_md5(folder)
    parts = []
    for files in (CIFAR_TRAIN_FILES, CIFAR_TEST_FILES):
        batches = [read_cifar_batch(folder / name) for name in files]
        parts.append(
            (
                torch.from_numpy(np.concatenate([x for x, _ in batches])),
                torch.from_numpy(np.concatenate([y for _, y in batches])),
            )
        )
    return parts  # [(train uint8 (N, 3, 32, 32), labels), (test ..., labels)]


def build_cifar10(name: str, options: Mapping[str, Any], root: Path) -> DataBundle:
    check_variant(name, options, ("plain",), default="plain")
    seed = int_option(options, "split_seed")
    (train_x, train_y), (test_x, test_y) = _read_cifar(
        root,
        download=bool(option(options, "download", True)),
        verify_md5=bool(option(options, "verify_md5", True)),
    )
    train_idx, val_idx = _holdout(len(train_y), CIFAR_VAL_DIVISOR, seed)
    augment = augmentation(name, options)
    datasets = {}
    for split, (x, y, indices) in {
        "train": (train_x, train_y, train_idx),
        "val": (train_x, train_y, val_idx),
        "test": (test_x, test_y, torch.arange(len(test_y))),
    }.items():
        indices = _take(indices, options, split, seed)
        datasets[split] = ImageTensorDataset(
            x[indices],  # uint8, scaled on access
            y[indices],
            mean=CIFAR_MEAN,
            std=CIFAR_STD,
            augment=augment if split == "train" else None,
        )
    return DataBundle(
        train=datasets["train"],
        val=datasets["val"],
        test=datasets["test"],
        spec=spec(name, options),
    )


# --- PCam -------------------------------------------------------------------------------------


class PCamDataset(Dataset):
    """PatchCamelyon images read lazily from HDF5: ``(x float32 (3, 96, 96) in [0, 1], y)``.

    ``x.h5`` holds dataset ``x`` (N, 96, 96, 3) uint8, ``y.h5`` holds ``y`` (N, 1, 1, 1).
    Labels are read at once; images on access, through one file handle per process (the
    handle is reopened after a fork, so DataLoader workers each get their own).
    """

    def __init__(self, x_path: Path, y_path: Path, augment=None) -> None:
        import h5py

        self.x_path = Path(x_path)
        self.augment = augment
        try:
            with h5py.File(x_path, "r") as fx, h5py.File(y_path, "r") as fy:
                shape, dtype = fx["x"].shape, fx["x"].dtype
                labels = np.asarray(fy["y"]).reshape(-1)
        except (OSError, KeyError) as err:
            raise DataError(
                f"{x_path} / {y_path} are not PCam HDF5 files with datasets 'x' and 'y' "
                f"({err}); replace them"
            ) from None
        if len(shape) != 4 or shape[1:] != (96, 96, 3) or dtype != np.uint8:
            raise DataError(f"{x_path}: 'x' is {dtype} {shape}, expected uint8 (N, 96, 96, 3)")
        if labels.shape[0] != shape[0]:
            raise DataError(f"{y_path} has {labels.shape[0]} labels for {shape[0]} images")
        self.indices = list(range(shape[0]))
        self.labels = torch.from_numpy(labels.astype(np.int64))
        self._file = None
        self._pid = None

    def __len__(self) -> int:
        return len(self.indices)

    def select(self, positions: torch.Tensor) -> PCamDataset:
        """The items at ``positions`` of this dataset (a view on the same files)."""
        subset = copy.copy(self)
        subset.indices = [self.indices[i] for i in positions.tolist()]
        subset.labels = self.labels[positions]
        subset._file, subset._pid = None, None
        return subset

    def _images(self):
        if self._file is None or self._pid != os.getpid():
            import h5py

            self._file = h5py.File(self.x_path, "r")
            self._pid = os.getpid()
        return self._file["x"]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        pixels = self._images()[self.indices[index]]  # (96, 96, 3) uint8
        x = torch.from_numpy(pixels).permute(2, 0, 1).float() / 255.0  # (3, 96, 96)
        if self.augment is not None:
            x = self.augment(x)
        return x, int(self.labels[index])

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_file"], state["_pid"] = None, None  # handles do not cross processes
        return state


def _pcam_missing(root: Path, why: str) -> DataError:
    names = [name for split in PCAM_SPLITS for name in _pcam_files(split)]
    return missing_files_error(
        "pcam",
        names,
        root / PCAM_FOLDER,
        why,
        "Download them (gunzipped) from https://github.com/basveeling/pcam, or run with "
        "data.download=true (the default) on a machine with network and the gdown package.",
    )


def build_pcam(name: str, options: Mapping[str, Any], root: Path) -> DataBundle:
    check_variant(name, options, ("plain",), default="plain")
    seed = int_option(options, "split_seed")
    folder = root / PCAM_FOLDER
    needed = [folder / name for split in PCAM_SPLITS for name in _pcam_files(split)]
    if not all(path.is_file() for path in needed):
        if not option(options, "download", True):
            raise _pcam_missing(root, "files not found and data.download=false")
        from torchvision.datasets import PCAM

        try:
            for split in ("train", "val", "test"):
                PCAM(str(root), split=split, download=True)
        except DOWNLOAD_ERRORS as err:
            raise _pcam_missing(root, f"download failed: {_one_line(err)}") from None
    augment = augmentation(name, options)
    datasets = {}
    for split in PCAM_SPLITS:
        x_name, y_name = _pcam_files(split)
        full = PCamDataset(
            folder / x_name, folder / y_name, augment=augment if split == "train" else None
        )
        datasets[split] = full.select(_take(torch.arange(len(full)), options, split, seed))
    return DataBundle(
        train=datasets["train"],
        val=datasets["val"],
        test=datasets["test"],
        spec=spec(name, options),
    )


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


BUILDERS = {"mnist": build_mnist, "cifar10": build_cifar10, "pcam": build_pcam}


def build(name: str, options: Mapping[str, Any], root: Path) -> DataBundle:
    if name not in BUILDERS:
        raise DataError(f"dataset {name!r} is not one of {list(BUILDERS)}")
    return BUILDERS[name](name, options, root)
