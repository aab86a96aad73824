"""Attention maps over the group: the lifting layer's maps turn with the input, exactly."""

from __future__ import annotations

import pytest
import torch
from matplotlib.image import imread

import symattn_cli
from symattn_cli.groups import get_group
from symattn_cli.verify.attention_maps import (
    attention_figure,
    lifting_attention_maps,
    plot_attention_maps,
    turning_element,
)
from symattn_cli.verify.gsa import randomize_encodings


def test_turning_element_prefers_a_quarter_turn():
    names = {name: get_group(name) for name in ("z2", "mirror", "z4", "r8", "r12", "z4m")}
    picked = {name: turning_element(g) for name, g in names.items()}
    assert picked["z2"] is None
    assert names["mirror"].is_reflection(picked["mirror"])
    for name in ("z4", "r8", "r12", "z4m"):
        g = names[name]
        assert not g.is_reflection(picked[name]) and g.describe(picked[name]) == "rot90"


@pytest.mark.parametrize("group", ["z4", "r8", "mirror", "z4m", "z2"])
def test_maps_of_the_turned_image_are_the_turned_maps(tmp_path, group):
    torch.manual_seed(0)
    model = symattn_cli.create_model("gsa_mini", group=group, channels=8, heads=2)
    model = randomize_encodings(model).double().eval()
    image = torch.zeros(1, 1, 28, 28, dtype=torch.float64)
    image[..., 6:20, 9:13] = torch.rand(14, 4, dtype=torch.float64)  # an off-centre stroke
    maps = lifting_attention_maps(model, image)
    g = get_group(group)
    assert maps.maps.shape == (g.order, 3, 3)
    torch.testing.assert_close(maps.maps.sum((-2, -1)), torch.ones(g.order, dtype=torch.float64))
    assert maps.maps.std() > 1e-3  # a query on the stroke: not a flat map
    assert maps.max_difference <= 1e-12
    # the first group layer: a distribution over key elements m for every output v
    weights = maps.group_weights
    assert weights.shape == (g.order, g.order)
    torch.testing.assert_close(weights.sum(-1), torch.ones(g.order, dtype=torch.float64))
    assert maps.group_difference <= 1e-12
    if group == "z2":
        assert maps.element is None and maps.moved_maps is None
    else:
        assert maps.moved_pixel != maps.pixel or group == "mirror"
        # not the trivial case: the maps differ between output elements, and turning the
        # input moves the group layer's weights to other key elements
        assert (maps.maps - maps.maps[:1]).abs().max() > 1e-4
        assert (maps.moved_group_weights - weights).abs().max() > 1e-4
    path = plot_attention_maps(maps, tmp_path / "attention.png", title=group)
    assert imread(path).shape[1] >= 100 * (g.order + 1)


def test_global_attention_maps_cover_the_image_and_turn(tmp_path):
    torch.manual_seed(0)
    model = symattn_cli.create_model(
        "gsa_mini", group="z4", channels=8, heads=2, patch_size="global"
    )
    model = randomize_encodings(model).double().eval()
    image = torch.zeros(1, 1, 12, 12, dtype=torch.float64)  # pooled to 6 x 6
    image[..., 2:9, 3:6] = torch.rand(7, 3, dtype=torch.float64)
    maps = lifting_attention_maps(model, image)
    assert maps.patch_size is None and maps.maps.shape == (4, 6, 6)
    assert maps.max_difference <= 1e-12
    plot_attention_maps(maps, tmp_path / "attention.png")


@pytest.mark.parametrize("group", ["z4", "mirror"])
def test_figure_says_it_with_titles_labels_and_a_legend(group):
    """No paragraph above the panels: a two-line title, short panel titles, labelled axes and
    colour bars, a legend for the marks; the explanation lives in docs/gsa-nets.md."""
    import matplotlib.pyplot as plt

    torch.manual_seed(0)
    model = symattn_cli.create_model("gsa_mini", group=group, channels=8, heads=2)
    model = randomize_encodings(model).double().eval()
    image = torch.zeros(1, 1, 28, 28, dtype=torch.float64)
    image[..., 6:20, 9:13] = torch.rand(14, 4, dtype=torch.float64)
    fig = attention_figure(lifting_attention_maps(model, image), title="GSANet on digits: run")
    try:
        heading = fig.get_suptitle().splitlines()
        assert len(heading) == 2 and all(len(line) <= 100 for line in heading), heading
        assert all(len(ax.get_title()) <= 40 for ax in fig.axes)
        labels = {ax.get_xlabel() for ax in fig.axes} | {ax.get_ylabel() for ax in fig.axes}
        assert {"key element m", "attention weight", "weight on m", "output v"} <= labels
        (legend,) = fig.legends
        assert [text.get_text() for text in legend.get_texts()] == ["query", "3×3 neighbourhood"]
        moved = "flipped by rot0*mirror" if group == "mirror" else "turned by rot90"
        assert moved in [ax.get_title() for ax in fig.axes]
    finally:
        plt.close(fig)
