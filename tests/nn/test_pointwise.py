"""The 1x1 maps as matrix products: the values and gradients of torch's 1x1 convolutions,
with their parameters and state dicts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from symattn_cli.commands.common import keep_freed_memory
from symattn_cli.nn.pointwise import Pointwise2d, Pointwise3d, pointwise


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "shape, kind", [((3, 5, 4, 7), Pointwise2d), ((3, 5, 4, 6, 2), Pointwise3d)]
)
def test_pointwise_maps_equal_1x1_convolutions(shape, kind, bias):
    torch.manual_seed(0)
    conv = (nn.Conv2d if kind is Pointwise2d else nn.Conv3d)(5, 6, 1, bias=bias).double()
    ours = kind(5, 6, bias=bias).double()
    ours.load_state_dict(conv.state_dict())  # the same parameter names and shapes
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(shape[0], 6, *shape[2:], dtype=torch.float64)
    a, b = conv(x), ours(x)
    assert b.shape == a.shape and torch.allclose(a, b, rtol=0, atol=1e-13)
    grads_a = torch.autograd.grad((a * weights).sum(), [x, *conv.parameters()])
    grads_b = torch.autograd.grad((b * weights).sum(), [x, *ours.parameters()])
    for ga, gb in zip(grads_a, grads_b, strict=True):
        assert torch.allclose(ga, gb, rtol=0, atol=1e-12)


def test_pointwise_reads_strided_input():
    """A cropped (non-contiguous) map is read as it is."""
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)[..., 1:-1, 1:-1]
    w, b = torch.randn(4, 3, 1, 1, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    assert torch.allclose(pointwise(x, w, b), F.conv2d(x, w, b), rtol=0, atol=1e-13)


def test_keeping_freed_memory_changes_no_result():
    keep_freed_memory()  # a process setting: safe to call again, and everywhere
    keep_freed_memory()
    x = torch.randn(256, 1024)
    assert torch.equal(x.clone(), x)
