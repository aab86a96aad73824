"""Fixtures of the layer tests."""

from __future__ import annotations

import contextlib

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


@pytest.fixture(scope="session")
def other_width_kernel():
    """The C++ kernel built with tiles of the other vector width than the host's (32 bytes on
    an AVX-512 host, else 64): both widths are checked wherever the tests run."""
    module = gsa_cpp.load()
    assert module is not None, "the C++ attention kernel did not build"
    return gsa_cpp.load_source(gsa_cpp.SOURCE, vector_bytes=96 - module.vector_bytes)


def _at_width(request, other: bool):
    """Runs the enclosed code on the other-width kernel (``other``), else on the host's."""
    if not other:
        return contextlib.nullcontext()
    return gsa_cpp.using(request.getfixturevalue("other_width_kernel"))


@pytest.fixture(params=["host-width", "other-width"])
def kernel_at_each_width(request, kernel) -> None:
    """For tests of the C++ kernel's tiles: runs the test with the kernel built at the host's
    vector width, then at the other one."""
    with _at_width(request, request.param == "other-width"):
        yield


@pytest.fixture(params=["cpp", "cpp-other-width", "torch"])
def backend(request):
    """Runs a test on each backend of the attention core that runs on the CPU, the C++ kernel
    at both vector widths."""
    if request.param == "torch":
        yield "torch"
        return
    request.getfixturevalue("kernel")
    with _at_width(request, request.param == "cpp-other-width"):
        yield "cpp"


@pytest.fixture(scope="module")
def triton_device() -> str:
    """Where the Triton kernels run here: the GPU, or the CPU in Triton's interpreter."""
    pytest.importorskip("triton", reason="Triton ships with PyTorch's CUDA wheels only")
    if gsa_triton.interpreted():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip(f"no GPU, and Triton was imported without its interpreter ({gsa_triton.ENV}=1)")
