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
def cpu_loops(request, monkeypatch) -> str:
    """Runs a test with the attention core's chunk loops in Python, then in C++ (for tests of
    what only the CPU paths do: worker threads, scratch buffers)."""
    return _use_loops(request.param, monkeypatch)


def _use_loops(kind: str, monkeypatch) -> str:
    """The core's chunk loops in C++ for ``kind == "native"``, else in Python."""
    if kind == "native":
        _require_native()
    monkeypatch.setattr(core, "NATIVE", kind == "native")
    return kind


@pytest.fixture(params=["python", "native", "accelerator"])
def loops(request, monkeypatch):
    """As :func:`cpu_loops`, then once more on the paths a GPU takes (no packed products, no
    0/1-matrix sums, fresh buffers, one thread, the Python loops), here on the CPU. For the
    last, the test also fails if it never reached a device decision of the core, or if a
    CPU-only helper ran."""
    _use_loops(request.param, monkeypatch)
    if request.param != "accelerator":
        yield request.param
        return
    asked = []
    monkeypatch.setattr(core, "_host_paths", lambda device: asked.append(device) or False)
    monkeypatch.setattr(core, "_segments", _forbidden("the 0/1-matrix sums"))
    monkeypatch.setattr(core, "ThreadPoolExecutor", _forbidden("a pool of CPU threads"))
    yield request.param
    assert asked, "the test reached no device decision of the attention core"


def _forbidden(what: str):
    def call(*args, **kwargs):
        raise AssertionError(f"{what} ran on the paths a GPU takes")

    return call
