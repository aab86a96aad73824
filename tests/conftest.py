"""Fixtures shared by all tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A launch directory outside the checkout (runs land in its outputs/)."""
    return tmp_path
