"""The CPU-sized models compared on rotmnist_mini have the same parameter count within 5%."""

from __future__ import annotations

import symattn_cli
from symattn_cli.models.instantiate import model_config

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
