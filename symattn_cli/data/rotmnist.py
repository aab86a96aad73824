"""``rotmnist``: the rotated MNIST of Larochelle et al. (ICML 2007), ``mnist_rotation_new``.

On disk: ``mnist_rotation_new.zip`` holding two text files, or the two files unpacked —
``mnist_all_rotation_normalized_float_train_valid.amat`` (12,000 rows) and
``mnist_all_rotation_normalized_float_test.amat`` (50,000 rows). Each row is 784 floats in
[0, 1] (a 28×28 image, row-major) followed by the label written as a float.

Split: the first 10,000 rows of train_valid train, its last 2,000 validate, the 50,000 test
rows test. Pixels stay float32 as written (no 8-bit quantisation).

The files are looked for in ``root`` and ``root/rotmnist`` (``root`` is the ``data/``
folder). Parsing the ~60k rows of text takes seconds, so the arrays are cached once as
``mnist_rotation_new.npz`` (float32) next to the source; later runs load that instead.
Without any source and with ``download`` on, the zip is fetched to ``root/rotmnist``.
"""

from __future__ import annotations

import io
import os
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from symattn_cli.data import image_common
from symattn_cli.data.base import DataBundle, DataError
from symattn_cli.data.image_common import (
    ImageTensorDataset,
    check_variant,
    classify_spec,
    int_option,
    md5_of,
    missing_files_error,
    option,
    subsample,
)

URL = "http://www.iro.umontreal.ca/~lisa/icml2007data/mnist_rotation_new.zip"
ZIP_NAME = "mnist_rotation_new.zip"
TRAIN_VALID_NAME = "mnist_all_rotation_normalized_float_train_valid.amat"
TEST_NAME = "mnist_all_rotation_normalized_float_test.amat"
CACHE_NAME = "mnist_rotation_new.npz"
SUBFOLDER = "rotmnist"

# md5 of mnist_rotation_new.zip as cited by several public loaders that verify it on download
# (with torchvision's download_and_extract_archive). It could not be confirmed here (no copy
# of the file, no network), so it is checked, but a mismatch names both sums and says how to
# proceed (data.verify_md5=false). Whatever the md5, the structure is always checked: row
# counts, 785 columns, pixels in [0, 1], integer labels 0–9. None = no known sum.
ZIP_MD5: str | None = "0f9a947ff3d30e95cd685462cbf3b847"

ROWS_TRAIN_VALID = 12_000
ROWS_TEST = 50_000
NUM_VAL = 2_000  # the last rows of train_valid
IMAGE_SIZE = 28
CACHE_VERSION = 1


def _candidate_folders(root: Path) -> list[Path]:
    return [root, root / SUBFOLDER]


def _files() -> tuple[tuple[str, str, int], ...]:
    """(array key, file name, rows expected) of the two text files."""
    return (("train_valid", TRAIN_VALID_NAME, ROWS_TRAIN_VALID), ("test", TEST_NAME, ROWS_TEST))


def _read_amat(stream, source: str, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Parse one .amat text stream: float32 images ``(rows, 784)``, int64 labels ``(rows,)``."""
    try:
        table = np.loadtxt(stream, dtype=np.float64, ndmin=2)  # (rows, 785)
    except ValueError as err:
        raise DataError(f"{source} is not a table of numbers ({err}); replace the file") from None
    columns = IMAGE_SIZE * IMAGE_SIZE + 1
    if table.shape != (rows, columns):
        raise DataError(
            f"{source} has {table.shape[0]} rows of {table.shape[1]} numbers, expected "
            f"{rows} rows of {columns} (784 pixels, then the label); the file is truncated or "
            f"not the Larochelle et al. rotated MNIST: replace it (see data/README.md)"
        )
    pixels, labels = table[:, :-1], table[:, -1]
    if pixels.min() < 0.0 or pixels.max() > 1.0:
        raise DataError(
            f"{source} has pixel values in [{pixels.min()}, {pixels.max()}], expected [0, 1]; "
            f"replace the file (see data/README.md)"
        )
    if not np.all(labels == np.round(labels)) or labels.min() < 0 or labels.max() > 9:
        raise DataError(f"{source} has labels that are not integers 0–9; replace the file")
    return pixels.astype(np.float32), labels.astype(np.int64)


def _parse_zip(path: Path) -> dict[str, np.ndarray]:
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise DataError(f"{path} is not a valid zip file; delete it and try again") from None
    with archive:
        members = {Path(info.filename).name: info.filename for info in archive.infolist()}
        absent = [name for name in (TRAIN_VALID_NAME, TEST_NAME) if name not in members]
        if absent:
            raise DataError(
                f"{path} does not contain {', '.join(absent)}; it is not the rotated MNIST "
                f"archive: delete it and try again"
            )
        arrays = {}
        for key, name, rows in _files():
            with archive.open(members[name]) as raw:
                text = io.TextIOWrapper(raw, encoding="ascii")
                x, y = _read_amat(text, f"{path}:{name}", rows)
            arrays[f"{key}_x"], arrays[f"{key}_y"] = x, y
    return arrays


def _parse_folder(folder: Path) -> dict[str, np.ndarray]:
    arrays = {}
    for key, name, rows in _files():
        with open(folder / name, encoding="ascii") as text:
            x, y = _read_amat(text, str(folder / name), rows)
        arrays[f"{key}_x"], arrays[f"{key}_y"] = x, y
    return arrays


def _load_cache(path: Path) -> dict[str, np.ndarray] | None:
    """The cached arrays, or None when the cache is absent, unreadable or of another shape."""
    if not path.is_file():
        return None
    try:
        with np.load(path) as cache:
            arrays = {key: cache[key] for key in cache.files}
    except (OSError, ValueError, zipfile.BadZipFile):
        return None
    expected = {
        "train_valid_x": (ROWS_TRAIN_VALID, IMAGE_SIZE * IMAGE_SIZE),
        "train_valid_y": (ROWS_TRAIN_VALID,),
        "test_x": (ROWS_TEST, IMAGE_SIZE * IMAGE_SIZE),
        "test_y": (ROWS_TEST,),
    }
    if int(arrays.get("version", -1)) != CACHE_VERSION:
        return None
    if any(key not in arrays or arrays[key].shape != shape for key, shape in expected.items()):
        return None
    return arrays


def _save_cache(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write the cache atomically; a read-only folder only costs the next run a re-parse."""
    part = path.with_name(path.name + ".part")
    try:
        with open(part, "wb") as f:
            np.savez(f, version=np.int64(CACHE_VERSION), **arrays)
        os.replace(part, path)
    except OSError as err:
        part.unlink(missing_ok=True)
        warnings.warn(
            f"could not cache rotated MNIST at {path} ({err}); it is re-parsed next time",
            stacklevel=3,
        )


def _check_md5(path: Path, verify: bool) -> None:
    if not verify or ZIP_MD5 is None:
        return
    actual = md5_of(path)
    if actual != ZIP_MD5:
        raise DataError(
            f"{path} has md5 {actual}, expected {ZIP_MD5}: the file is damaged or a different "
            f"version. Delete it to download it again, or set data.verify_md5=false to use "
            f"it anyway (its structure is still checked)"
        )


def _fetch(root: Path, verify: bool) -> Path:
    dest = root / SUBFOLDER / ZIP_NAME
    try:
        image_common.download(URL, dest)
    except image_common.NETWORK_ERRORS as err:
        raise _missing(root, f"download from {URL} failed: {err}") from None
    try:
        _check_md5(dest, verify)
    except DataError:
        dest.unlink(missing_ok=True)
        raise
    return dest


def _missing(root: Path, why: str) -> DataError:
    return missing_files_error(
        "rotmnist",
        [f"{ZIP_NAME} (or the two files it holds, {TRAIN_VALID_NAME} and {TEST_NAME})"],
        root / SUBFOLDER,
        why,
        f"Download {URL} and put it there (or in {root}), or run with data.download=true "
        f"(the default) on a machine with network; data=rotmnist_mini works offline.",
    )


def load_arrays(root: Path, download: bool, verify_md5: bool) -> dict[str, np.ndarray]:
    """The four arrays ``train_valid_x/_y``, ``test_x/_y``, from cache, files or download."""
    folders = _candidate_folders(root)
    for folder in folders:
        cached = _load_cache(folder / CACHE_NAME)
        if cached is not None:
            return cached
    source: tuple[str, Path] | None = None
    for folder in folders:
        if (folder / TRAIN_VALID_NAME).is_file() and (folder / TEST_NAME).is_file():
            source = ("folder", folder)
            break
        if (folder / ZIP_NAME).is_file():
            source = ("zip", folder / ZIP_NAME)
            break
    if source is None:
        if not download:
            raise _missing(root, "files not found and data.download=false")
        source = ("zip", _fetch(root, verify_md5))
    kind, path = source
    if kind == "zip":
        _check_md5(path, verify_md5)
        arrays = _parse_zip(path)
        cache_folder = path.parent
    else:
        arrays = _parse_folder(path)
        cache_folder = path
    _save_cache(cache_folder / CACHE_NAME, arrays)
    return arrays


def build(name: str, options: Mapping[str, Any], root: Path) -> DataBundle:
    check_variant(name, options, ("rotated",), default="rotated")
    seed = int_option(options, "split_seed")
    arrays = load_arrays(
        root,
        download=bool(option(options, "download", True)),
        verify_md5=bool(option(options, "verify_md5", True)),
    )

    def images(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x)).view(-1, 1, IMAGE_SIZE, IMAGE_SIZE)

    n_train = ROWS_TRAIN_VALID - NUM_VAL
    parts = {
        "train": (arrays["train_valid_x"][:n_train], arrays["train_valid_y"][:n_train]),
        "val": (arrays["train_valid_x"][n_train:], arrays["train_valid_y"][n_train:]),
        "test": (arrays["test_x"], arrays["test_y"]),
    }
    datasets = {}
    for split, (x, y) in parts.items():
        requested = int_option(options, f"num_{split}")
        keep = subsample(len(y), requested, seed, split, f"data.num_{split}")
        x_t, y_t = images(x), torch.from_numpy(y)
        if keep is not None:
            x_t, y_t = x_t[keep], y_t[keep]
        datasets[split] = ImageTensorDataset(x_t, y_t)
    spec = classify_spec(options, 10, 1, IMAGE_SIZE, "rotmnist")
    return DataBundle(
        train=datasets["train"], val=datasets["val"], test=datasets["test"], spec=spec
    )
