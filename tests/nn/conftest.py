"""Fixtures of the layer tests."""

from __future__ import annotations

import pytest

import symattn_cli.nn.gsa_core as core
from symattn_cli.nn import gsa_native


def _require_native() -> None:
    """The C++ extension must build here (a C++ compiler and ninja) unless SYMATTN_NATIVE=0
    says not to use it."""
    if not gsa_native.enabled():
        pytest.skip(f"{gsa_native.ENV}=0: the C++ loops are turned off")
    assert gsa_native.load() is not None, "the C++ attention core did not build"


@pytest.fixture
def native() -> None:
    """For tests of the C++ chunk loops."""
    _require_native()


@pytest.fixture(params=["python", "native"])
def loops(request, monkeypatch) -> str:
    """Runs a test with the attention core's chunk loops in Python, then in C++."""
    if request.param == "native":
        _require_native()
    monkeypatch.setattr(core, "NATIVE", request.param == "native")
    return request.param
