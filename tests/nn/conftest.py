"""Fixtures of the layer tests."""

from __future__ import annotations

import pytest

from symattn_cli.nn.gsa import cpp as gsa_cpp


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
