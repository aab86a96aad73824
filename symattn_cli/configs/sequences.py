"""Typed configs of the generated sequence tasks (``conf/data/{arithmetic,sort,reverse}.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SequenceDataConfig:
    name: str = "arithmetic"
    kind: str = "sequence"
    variant: str = "two_digit"  # arithmetic: two_digit | single_digit
    # split sizes; arithmetic: all 0 = 80/10/10 of every distinct expression (20,000 / 200)
    num_train: int = 0
    num_val: int = 0
    num_test: int = 0
    num_test_long: int = 0  # sort / reverse: 0 = num_test
    min_len: int = 4  # sort / reverse: training lengths drawn from [min_len, max_len]
    max_len: int = 8
    test_min_len: int = 0  # test_long lengths; 0 = max_len + 1
    test_max_len: int = 0  # 0 = max(test_min_len, 2 * max_len)
    num_symbols: int = 10  # sort / reverse alphabet (digits 0..num_symbols-1)
    split_seed: int = 0
    arch: str = "sequence"


SCHEMAS: list[tuple[str | None, str, Any]] = [
    (None, "sequence_schema", SequenceDataConfig),
]
