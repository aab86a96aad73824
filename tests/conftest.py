"""Fixtures shared by all tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_configure(config) -> None:
    """Without a GPU, Triton kernels run in Triton's interpreter, on CPU tensors. Triton reads
    the switch once, as it is imported: before any test imports it."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def native_attention_core() -> None:
    """Builds (or loads from torch's extension cache) the C++ attention core once, for tests
    that start a process which attends with it (``symattn`` in a subprocess, a benchmark's
    child process): that process finds the build instead of compiling it within the test's
    time limit. Tests in this process build it on first use, or through the ``kernel``
    fixture of ``tests/nn``."""
    from symattn_cli.nn.gsa import cpp as gsa_cpp

    gsa_cpp.load()


@pytest.fixture(params=["in-process", pytest.param("subprocess", marks=pytest.mark.slow)])
def symattn(request):
    """The ``symattn`` program: ``symattn(*args, cwd=...)`` runs it and returns its exit
    status and output (a ``subprocess.CompletedProcess``). Each test that takes it runs twice:
    by the dispatcher's ``main`` in this process (``tests.helpers.call_symattn``; in the quick
    loop) and as ``python -m symattn_cli`` in a subprocess (``tests.helpers.run_symattn``;
    marked slow), so that the quick loop checks what the program does and the full suite
    checks it as a program too."""
    from tests.helpers import call_symattn, run_symattn

    if request.param == "subprocess":
        request.getfixturevalue("native_attention_core")
        return run_symattn
    return call_symattn


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A launch directory outside the checkout (runs land in its outputs/)."""
    return tmp_path
