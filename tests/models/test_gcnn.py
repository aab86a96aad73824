"""P4CNN baseline: exact invariance on quarter turns (and reflections), errors for people."""

from __future__ import annotations

import pytest
import torch

import symattn_cli
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
