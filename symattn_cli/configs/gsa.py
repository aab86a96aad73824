"""Typed configs of the GSA-Net family (``conf/model/*_sa.yaml``) and the P4CNN baseline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from symattn_cli.configs.data import (
    DATA_ARCH,
    DATA_IMAGE_SIZE,
    DATA_IN_CHANNELS,
    DATA_NUM_CLASSES,
)
from symattn_cli.options import (
    DEFAULT_ATTENTION_BACKEND,
    DEFAULT_GROUP_INDEX,
    DEFAULT_NORM,
    DEFAULT_QUERY_FORM,
)


@dataclass
class GSANetConfig:
    """GSA-Net options; architecture values left empty (0, null, []) come from the preset
    of ``arch`` (auto: the one the data suggests: rotmnist | cifar10 | pcam). The choices and
    defaults of ``query_form``, ``group_index``, ``norm``, ``attention_backend`` and the word
    ``global`` of ``patch_size`` are :mod:`symattn_cli.options`."""

    _target_: str = "symattn_cli.models.gsa_net.build"
    group: str = "z2"  # z2 | z4 (r4) | r8 | r12 | r16 | mirror (z2m) | z4m (r4m) | r8m
    arch: str = DATA_ARCH  # auto | rotmnist | cifar10 | pcam; by default the data's
    query_form: str = DEFAULT_QUERY_FORM  # sum (GSA-Nets Eq. 16) | single
    group_index: str = DEFAULT_GROUP_INDEX  # pair | gevit | relative | shifted
    channels: int = 0
    heads: int = 0
    block_sizes: list[int] = field(default_factory=list)
    expansion: list[int] = field(default_factory=list)
    crops: list[int] = field(default_factory=list)
    # odd P: P x P local attention; global: every pixel attends to every pixel; 0: the
    # preset's (typed Any so that one option holds a number or the word global)
    patch_size: Any = 0
    attention_dropout: float = 0.1
    value_dropout: float = 0.1
    input_dropout: float = 0.0
    pool_dropout: float = 0.0
    input_pool: int = 1  # average-pool the input by this factor first (CPU presets)
    norm: str = DEFAULT_NORM  # layer (the reference's GroupNorm(1, C)) | batch (BatchNorm3d)
    checkpointing: bool = True  # torch backend: recompute attention in the backward (memory)
    chunk_elements: int = 0  # torch backend: numbers in its largest chunk tensor; 0 = auto
    # the attention core's backend: auto | cpp | triton | triton_tiles | torch, or dense (the
    # reference algorithm)
    attention_backend: str = DEFAULT_ATTENTION_BACKEND
    in_channels: int = DATA_IN_CHANNELS
    num_classes: int = DATA_NUM_CLASSES
    image_size: int = DATA_IMAGE_SIZE  # checks that the crops leave a map


@dataclass
class GCNNConfig:
    """P4CNN-style group convolutional baseline (lifting + group convolutions)."""

    _target_: str = "symattn_cli.models.gcnn.build"
    group: str = "z4"  # z2 | z4 | mirror | z4m (grid-exact groups only)
    channels: list[int] = field(default_factory=lambda: [10, 10, 10, 10, 10, 10, 10])
    kernel_size: int = 3
    pool_after: list[int] = field(default_factory=lambda: [1])  # 2x2 max-pool after layer i
    dropout: float = 0.3
    input_pool: int = 1  # average-pool the input by this factor first (as the GSA-Nets)
    in_channels: int = DATA_IN_CHANNELS
    num_classes: int = DATA_NUM_CLASSES
    image_size: int = DATA_IMAGE_SIZE  # checks that every pooling has a map to pool


SCHEMAS: list[tuple[str | None, str, Any]] = [
    (None, "gsa_schema", GSANetConfig),
    (None, "gcnn_schema", GCNNConfig),
]
