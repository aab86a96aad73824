"""Typed configs of the convolutional baselines."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CNNConfig:
    family: str = "cnn"
    channels: list[int] = field(default_factory=lambda: [32, 64, 96])
    kernel_size: int = 3
    dropout: float = 0.1
    in_channels: int = 0  # 0 = from the data
    num_classes: int = 0  # 0 = from the data


SCHEMAS: list[tuple[str | None, str, Any]] = [
    (None, "cnn_schema", CNNConfig),
]
