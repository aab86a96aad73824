"""Typed configs of the convolutional baselines."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from symattn_cli.configs.data import DATA_IMAGE_SIZE, DATA_IN_CHANNELS, DATA_NUM_CLASSES


@dataclass
class CNNConfig:
    _target_: str = "symattn_cli.models.cnn.build"
    channels: list[int] = field(default_factory=lambda: [32, 64, 96])
    kernel_size: int = 3
    dropout: float = 0.1
    input_pool: int = 1  # average-pool the input by this factor first (as the GSA-Nets)
    in_channels: int = DATA_IN_CHANNELS
    num_classes: int = DATA_NUM_CLASSES
    image_size: int = DATA_IMAGE_SIZE  # checks that every pooling has a map to pool


SCHEMAS: list[tuple[str | None, str, Any]] = [
    (None, "cnn_schema", CNNConfig),
]
