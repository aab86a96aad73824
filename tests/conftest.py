"""Fixtures shared by all tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _native_attention_core() -> None:
    """Builds (or loads) the C++ attention core once, before any test starts ``symattn`` in
    a subprocess, which would otherwise compile it within that test's time limit."""
    from symattn_cli.nn import gsa_native

    gsa_native.load()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A launch directory outside the checkout (runs land in its outputs/)."""
    return tmp_path
