"""Typed configs of the generated sequence tasks (conf/data: arithmetic, addition, sort, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SequenceDataConfig:
    """A generated sequence task. Besides its options, the facts a model is sized by, filled in
    when the task is generated (``null`` until then): ``vocab_size`` and ``num_classes`` (the
    token vocabulary), ``seq_len`` (the longest sequence of any split), ``pad_index``,
    ``tokens`` (the token strings, index = id), ``answer_order`` (``lsd``: least significant
    answer digit first | ``msd``) and ``causal_answer`` (answers read causally, decoded
    greedily)."""

    _target_: str = "symattn_cli.data.sequences.dataset"
    name: str = "arithmetic"
    task: str = "tokens"
    vocab_size: int | None = None
    num_classes: int | None = None
    seq_len: int | None = None
    pad_index: int | None = None
    tokens: list[str] | None = None
    answer_order: str | None = None
    causal_answer: bool | None = None
    kind: str = "sequence"
    variant: str = "two_digit"  # arithmetic: two_digit | single_digit
    # split sizes; arithmetic: all 0 = 80/10/10 of every distinct expression (20,000 / 200)
    num_train: int = 0
    num_val: int = 0
    num_test: int = 0
    num_test_long: int = 0  # sort / reverse / addition: 0 = num_test
    num_test_longer: int = 0  # addition: 0 = num_test
    min_len: int = 4  # sort / reverse: training lengths drawn from [min_len, max_len]
    max_len: int = 8
    # test_long lengths; 0 = max_len + 1 (addition: max_digits + 1 digits)
    test_min_len: int = 0
    test_max_len: int = 0  # 0 = max(test_min_len, 2 * max_len) (addition: 3 * max_digits)
    min_digits: int = 1  # addition: operand lengths drawn from [min_digits, max_digits]
    max_digits: int = 10
    test_longer_min_len: int = 0  # addition test_longer digits; 0 = test_max_len + 1
    test_longer_max_len: int = 0  # 0 = 5 * max_digits
    test_100_digits: int = 100  # addition test_100: operands of exactly this many digits; 0: none
    num_test_100: int = 300
    test_1000_digits: int = 1000  # addition test_1000: likewise; 0: none
    num_test_1000: int = 300
    reverse_answer: bool = True  # addition: answer least significant digit first
    decoding: str = "one_pass"  # addition: one_pass (all slots at once) | causal
    num_symbols: int = 10  # sort / reverse alphabet (digits 0..num_symbols-1)
    split_seed: int = 0
    arch: str = "sequence"


SCHEMAS: list[tuple[str | None, str, Any]] = [
    (None, "sequence_schema", SequenceDataConfig),
]
