"""P4CNN baseline: exact invariance on quarter turns (and reflections), errors for people."""

from __future__ import annotations

import pytest
import torch

import symattn_cli
from symattn_cli.errors import ConfigError
from symattn_cli.groups import get_group


@pytest.mark.parametrize("group", ["z4", "z4m", "mirror"])
def test_gcnn_logits_are_invariant(group):
    torch.manual_seed(0)
    g = get_group(group)
    model = symattn_cli.create_model("gcnn", group=group).double().eval()
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    with torch.no_grad():
        y = model(x)
        for e in g.elements:
            err = (model(g.act_on_image(e, x)) - y).abs().max() / y.abs().max()
            assert err <= 1e-10


def test_gcnn_rejects_off_grid_groups():
    with pytest.raises(ValueError, match="quarter turns"):
        symattn_cli.create_model("gcnn", group="r8")


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("gcnn_mini", {"channels": []}, r"channels=\[\]: give one width of at least 1 a layer"),
        ("cnn_mini", {"channels": [8, 0]}, r"channels=\[8, 0\]: give one width"),
        ("cnn_mini", {"kernel_size": -1}, r"kernel_size=-1 must be odd and positive"),
        ("gcnn_mini", {"kernel_size": 4}, r"kernel_size=4 must be odd and positive"),
        ("gcnn_mini", {"pool_after": [1, 9]}, r"pool_after=\[1, 9\]: \[9\] name no layer"),
        ("cnn_mini", {"channels": [4] * 6},
         r"the pooling after layer 4 meets a 1x1 map \(28x28 images\)"),
        ("cnn_mini", {"channels": [4] * 5, "input_pool": 2},
         r"the pooling after layer 3 meets a 1x1 map \(28x28 images, input_pool=2\)"),
        ("gcnn_mini", {"pool_after": [0, 1, 2, 3], "input_pool": 2},
         r"the pooling after layer 3 meets a 1x1 map \(28x28 images, input_pool=2\)"),
        ("gcnn_mini", {"input_pool": 29}, r"input_pool=29 leaves no pixel of 28x28 images"),
    ],
)  # fmt: skip
def test_conv_baselines_refuse_layers_that_cannot_be_built(name, options, message):
    """Refused when built for the data, not as a shape error in the first step."""
    with pytest.raises(ValueError, match=message):
        symattn_cli.create_model(name, **options)


@pytest.mark.parametrize("name", ["cnn_mini", "gcnn_mini"])
@pytest.mark.parametrize("pool", [0, -2])
def test_conv_baselines_refuse_an_input_pool_below_one(name, pool):
    with pytest.raises(ConfigError, match=rf"^input_pool={pool} must be at least 1 \(1: no"):
        symattn_cli.create_model(name, input_pool=pool)


def test_layers_refused_on_pooled_input_build_on_the_full_input():
    """The layers refused above with input_pool=2 (14x14 maps) build on 28x28."""
    assert symattn_cli.create_model("cnn_mini", channels=[4] * 5) is not None
