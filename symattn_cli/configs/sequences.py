"""Typed configs of the generated sequence tasks (``conf/data/{arithmetic,sort,reverse}.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SequenceDataConfig:
    name: str = "arithmetic"
    kind: str = "sequence"
    variant: str = "two_digit"  # arithmetic: two_digit | single_digit
    num_train: int = 16000
    num_val: int = 2000
    num_test: int = 2000
    min_len: int = 4  # sort / reverse: training lengths drawn from [min_len, max_len]
    max_len: int = 8
    test_min_len: int = 0  # 0 = same as training; longer lengths test length generalisation
    test_max_len: int = 0
    num_symbols: int = 10
    split_seed: int = 0
    arch: str = "sequence"


SCHEMAS: list[tuple[str | None, str, Any]] = [
    ("data", "sequence_schema", SequenceDataConfig),
]
