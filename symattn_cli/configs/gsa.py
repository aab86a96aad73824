"""Typed configs of this model family (filled in with the family's models)."""

from __future__ import annotations

from typing import Any, Optional

SCHEMAS: list[tuple[Optional[str], str, Any]] = []
