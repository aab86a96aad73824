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


@pytest.fixture(scope="session", autouse=True)
def _native_attention_core() -> None:
    """Builds (or loads) the C++ attention core once, before any test starts ``symattn`` in
    a subprocess, which would otherwise compile it within that test's time limit."""
    from symattn_cli.nn.gsa import cpp as gsa_cpp

    gsa_cpp.load()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A launch directory outside the checkout (runs land in its outputs/)."""
    return tmp_path
