"""The public layer API (``symattn_cli.nn``): its names, their docstrings, and docs/api.md,
whose examples run here as written."""

from __future__ import annotations

import re

import pytest
import torch

import symattn_cli.nn as public
from symattn_cli.groups import get_group
from symattn_cli.nn.gsa.layer import GroupSelfAttention, LiftingSelfAttention
from symattn_cli.nn.pooling import GROUP_REDUCTIONS, SPATIAL_REDUCTIONS, GroupPool
from symattn_cli.options import (
    ATTENTION_BACKENDS,
    DEFAULT_ATTENTION_BACKEND,
    DEFAULT_GROUP_INDEX,
    DEFAULT_POSITION,
    DEFAULT_QUERY_FORM,
    GROUP_INDEX,
    POSITION_KINDS,
    QUERY_FORMS,
)
from tests.helpers import REPO

API = (REPO / "docs" / "api.md").read_text()


def _python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", API, re.M | re.S)


def test_every_public_name_exists_and_states_its_shapes():
    for name in public.__all__:
        item = getattr(public, name)
        doc = item.__doc__ or ""
        assert "Shapes" in doc, f"{name}: its docstring gives no shapes"


def test_the_public_names_are_the_layers_the_brief_asks_for():
    for name in ("LiftingSelfAttention", "GroupSelfAttention", "KnowledgeAttention",
                 "KnowledgeBlock", "Group", "get_group", "GroupPool"):  # fmt: skip
        assert name in public.__all__, name
    assert public.get_group is get_group  # one group object per name, however imported


def test_the_docstrings_list_each_options_choices():
    """The choices are declared once (symattn_cli.options, the pooling module); the docstrings
    name them all (the package's other texts: tests/test_options.py)."""
    gsa = GroupSelfAttention.__doc__
    for choice in (*QUERY_FORMS, *GROUP_INDEX, *POSITION_KINDS, *ATTENTION_BACKENDS):
        assert f'"{choice}"' in gsa, choice
    for choice in POSITION_KINDS:
        assert f'"{choice}"' in LiftingSelfAttention.__doc__, choice
    for default in (DEFAULT_QUERY_FORM, DEFAULT_GROUP_INDEX, DEFAULT_POSITION,
                    DEFAULT_ATTENTION_BACKEND):  # fmt: skip
        assert f'``"{default}"`` (default' in gsa, default  # the default it marks is the module's
    for choice in GROUP_REDUCTIONS + tuple(c for c in SPATIAL_REDUCTIONS if c):
        assert f'"{choice}"' in GroupPool.__doc__, choice


def test_the_api_page_names_every_export():
    for name in public.__all__:
        assert f"`{name}" in API, name


def test_the_custom_net_example_is_at_most_30_lines():
    first = _python_blocks()[0]
    assert len(first.splitlines()) <= 30
    assert "LiftingSelfAttention" in first and "GroupPool" in first


@pytest.mark.parametrize("index", range(2), ids=["equivariant-net", "knowledge-block"])
def test_the_api_page_examples_run(index):
    """Each example asserts its law (to 1e-10 in float64) and that the model is not blind."""
    blocks = _python_blocks()
    assert len(blocks) == 2
    exec(compile(blocks[index], f"docs/api.md block {index}", "exec"), {})


def test_the_lifting_layer_is_the_group_layer_with_lifting():
    torch.manual_seed(0)
    kwargs = dict(group=get_group("z4"), in_channels=2, out_channels=4, heads=2, patch_size=3)
    lifting = LiftingSelfAttention(**kwargs).double()
    general = GroupSelfAttention(lifting=True, **kwargs).double()
    general.load_state_dict(lifting.state_dict())
    x = torch.randn(1, 2, 6, 6, dtype=torch.float64)  # (B, C, H, W)
    torch.testing.assert_close(lifting(x), general(x), rtol=0, atol=0)
    assert lifting(x).shape == (1, 4, 4, 6, 6)  # (B, C', N, H, W)


def test_group_pooling_is_the_shipped_invariant_head():
    """``GroupPool(spatial="mean")`` is the shipped nets' head: a mean over space, then a max
    over the group axis; without ``spatial`` it permutes with the group like an image."""
    torch.manual_seed(0)
    group = get_group("z4m")
    f = torch.randn(2, 3, group.order, 4, 4, dtype=torch.float64)  # (B, C, N, H, W)
    head = GroupPool(reduction="max", spatial="mean")
    torch.testing.assert_close(head(f), f.mean(dim=(-2, -1)).amax(dim=-1), rtol=0, atol=0)
    pool = GroupPool(reduction="mean")
    for e in group.elements:
        moved = group.act_on_group_function(e, f)
        torch.testing.assert_close(head(moved), head(f), rtol=0, atol=1e-12)
        torch.testing.assert_close(pool(moved), group.act_on_image(e, pool(f)), rtol=0, atol=1e-12)
    assert pool(f).shape == (2, 3, 4, 4) and head(f).shape == (2, 3)


@pytest.mark.parametrize(
    "kwargs,match",
    [({"reduction": "sum"}, "reduction"), ({"spatial": "median"}, "spatial")],
)
def test_group_pooling_names_a_wrong_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GroupPool(**kwargs)


def test_group_pooling_refuses_a_tensor_without_a_group_axis():
    with pytest.raises(ValueError, match=r"\(B, C, N, H, W\)"):
        GroupPool(spatial="mean")(torch.zeros(2, 3, 4, 4))
