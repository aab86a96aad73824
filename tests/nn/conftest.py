"""Fixtures of the layer tests."""

from __future__ import annotations

import pytest
import torch

from symattn_cli.nn.gsa import cpp as gsa_cpp
from symattn_cli.nn.gsa import triton as gsa_triton


@pytest.fixture
def kernel() -> None:
    """For tests of the fused CPU kernel: it must build here (a C++ compiler and ninja) unless
    SYMATTN_CPP=0 says not to use it."""
    if not gsa_cpp.enabled():
        pytest.skip(f"{gsa_cpp.ENV}=0: the C++ kernel is turned off")
    assert gsa_cpp.load() is not None, "the C++ attention kernel did not build"


@pytest.fixture(params=["cpp", "torch"])
def backend(request) -> str:
    """Runs a test on each backend of the attention core that runs on the CPU."""
    if request.param == "cpp":
        request.getfixturevalue("kernel")
    return request.param


@pytest.fixture(scope="module")
def triton_device() -> str:
    """Where the Triton kernels run here: the GPU, or the CPU in Triton's interpreter."""
    pytest.importorskip("triton", reason="Triton ships with PyTorch's CUDA wheels only")
    if gsa_triton.interpreted():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip(f"no GPU, and Triton was imported without its interpreter ({gsa_triton.ENV}=1)")
