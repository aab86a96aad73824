"""The CPU-sized models compared on rotmnist_mini have the same parameter count within 5%,
at either input resolution (``input_pool`` 1: 28x28, 2: 14x14)."""

from __future__ import annotations

import pytest
import torch

import symattn_cli
from symattn_cli.models.instantiate import model_config
from symattn_cli.verify.records import RESPONSE, TOLERANCE

MATCHED = {  # model: (group, parameters)
    "z2_mini": ("z2", 21_570),
    "z2m_mini": ("mirror", 21_586),
    "r4_mini": ("z4", 21_618),
    "r4m_mini": ("z4m", 21_682),
    "r8_mini": ("r8", 21_682),
    "r8m_mini": ("r8m", 21_810),
    "cnn_mini": (None, 21_570),
    "gcnn_mini": ("z4", 22_010),
}


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_matched_models_are_within_five_percent_of_each_other():
    counts = {}
    for name, (group, expected) in MATCHED.items():
        model = symattn_cli.create_model(name)
        counts[name] = n_params(model)
        assert counts[name] == expected, (name, counts[name])
        if group is not None:
            assert model.group is symattn_cli.get_group(group), name
    assert max(counts.values()) <= 1.05 * min(counts.values()), counts


@pytest.mark.parametrize("name", sorted(MATCHED))
def test_matched_models_run_at_both_resolutions_with_the_same_parameters(name):
    """Input pooling has no parameters: the matched set stays matched at 14x14 and 28x28."""
    x = torch.randn(2, 1, 28, 28)
    for pool in (1, 2):
        model = symattn_cli.create_model(name, input_pool=pool).eval()
        assert n_params(model) == MATCHED[name][1], (name, pool)
        with torch.no_grad():
            assert model(x).shape == (2, 10)


INVARIANT = sorted(name for name, (group, _) in MATCHED.items() if group not in (None, "z2"))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", INVARIANT)
def test_pooled_invariant_models_stay_exactly_invariant(name):
    """2x2 average pooling of a 28x28 image commutes with quarter turns and reflections, so
    every grid-exact element of the model's group still leaves the logits unchanged."""
    torch.manual_seed(0)
    model = symattn_cli.create_model(name, input_pool=2).double().eval()
    group = model.group
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    with torch.no_grad():
        y = model(x)
        for e in group.grid_exact_elements():
            moved = model(group.act_on_image(e, x))
            assert _relative(moved, y) <= TOLERANCE["float64"], (name, group.describe(e))


@pytest.mark.parametrize("name", ["cnn_mini", "gcnn_mini", "r4_mini"])
def test_pooled_models_see_the_block_means_and_only_them(name):
    """With input_pool=2 the output responds to a random change of the input, but not to a
    change whose every 2x2 block sums to zero (what the pooling discards); at input_pool=1 it
    responds to that change too, so the pooling is applied, not ignored."""
    torch.manual_seed(0)
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    noise = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    block = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=torch.float64)
    scale = torch.randn(2, 1, 14, 14, dtype=torch.float64)
    scale = scale.repeat_interleave(2, -2).repeat_interleave(2, -1)  # (B, 1, 28, 28)
    hidden = block.repeat(14, 14) * scale  # (B, 1, 28, 28): each 2x2 block sums to zero
    pooled = symattn_cli.create_model(name, input_pool=2).double().eval()
    full = symattn_cli.create_model(name, input_pool=1).double().eval()
    with torch.no_grad():
        y = pooled(x)
        assert _relative(pooled(x + noise), y) >= RESPONSE
        assert _relative(pooled(x + hidden), y) <= TOLERANCE["float64"]
        assert _relative(full(x + hidden), full(x)) >= RESPONSE


def test_r4_mini_is_the_default_model():
    assert model_config("r4_mini") == model_config("gsa_mini")


def test_image_models_refuse_token_data_by_name():
    """An image classifier given a sequence task is refused before it is built, naming the
    fact it reads that the data does not state; knowledge attention still builds on it."""
    import pytest

    from symattn_cli.errors import ConfigError

    for name in ("cnn_mini", "gcnn_mini", "r4_mini"):
        with pytest.raises(ConfigError, match=r"model.in_channels: .*data.in_channels"):
            symattn_cli.create_model(name, data="arithmetic")
    assert symattn_cli.create_model("ka_softmax", data="arithmetic") is not None
