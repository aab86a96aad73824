"""Generated seq2seq tasks for knowledge attention: arithmetic, addition, sort, reverse.

Everything is generated from ``split_seed``; nothing is downloaded. Every item is
``(tokens, targets)``, both int64 (n,): the output has the input's length and the answer is
read at the ``_`` slots; ``targets`` is :data:`IGNORE_INDEX` everywhere else.

* ``arithmetic`` (``variant=two_digit``, default): ``d d op d d = _ _ _ _`` with op ∈ {+, −};
  the four slots hold the sign and three digits of the result (47 − 56 → ``- 0 0 9``). All
  100·100·2 = 20,000 distinct expressions, shuffled and split 80/10/10 by default: no
  expression is in two splits. ``variant=single_digit``: Ma & Ying's "2 + 1" example,
  ``d op d = _ _ _`` (sign and two digits), 200 expressions.
* ``sort`` / ``reverse``: ``s₁ … s_m = _ … _`` (m slots) → the m symbols sorted ascending, or
  reversed; m is drawn uniformly from [min_len, max_len]. Which split a sequence may appear
  in is fixed by a seeded hash of its content, so train, validation and test never share a
  sequence; ``test_long`` (lengths [test_min_len, test_max_len], longer than training)
  measures length generalisation.
* ``addition``: ``a₁ … a_p + b₁ … b_q = _ … _`` with the operands written most significant
  digit first (no leading zeros) and w = max(p, q) + 1 slots holding the digits of a + b,
  least significant first (``reverse_answer=true``, default) or most significant first
  (zero-padded to w). Operand lengths p, q are drawn independently from
  [min_digits, max_digits] for train / validation / test (split by a seeded hash of the
  expression, as for sort), from [test_min_len, test_max_len] (default 11–30) for
  ``test_long`` and [test_longer_min_len, test_longer_max_len] (default 31–50) for
  ``test_longer``, and exactly ``test_100_digits`` (default 100) and ``test_1000_digits``
  (default 1000) digits for ``test_100`` and ``test_1000`` (``num_test_100`` /
  ``num_test_1000`` problems each; a length of 0 drops the split): disjoint from training by
  their lengths. ``decoding=causal`` writes the
  answer for teacher forcing: the first answer position holds ``_``, each later one the answer
  digit before it (targets unchanged); the model must then read the answer causally
  (``DataSpec.causal_answer``) and decode greedily at evaluation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from symattn_cli.data.base import IGNORE_INDEX, DataBundle, DataError, DataSpec

PAD, SLOT, EQUALS, PLUS, MINUS = "<pad>", "_", "=", "+", "-"
DIGITS = tuple("0123456789")
ARITHMETIC_TOKENS = (PAD, SLOT, EQUALS, PLUS, MINUS, *DIGITS)
ADDITION_TOKENS = (PAD, SLOT, EQUALS, PLUS, *DIGITS)
VARIANTS = ("two_digit", "single_digit")
DECODINGS = ("one_pass", "causal")
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)  # train / validation / test


class SequenceTask(Dataset):
    """A list of ``(tokens, targets)`` pairs (int64 tensors of equal length)."""

    def __init__(self, items: Sequence[tuple[list[int], list[int]]]) -> None:
        self.items = [
            (torch.tensor(t, dtype=torch.int64), torch.tensor(y, dtype=torch.int64))
            for t, y in items
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.items[index]

    @property
    def max_len(self) -> int:
        return max((len(t) for t, _ in self.items), default=0)


class PadCollate:
    """Pad a batch to its longest sequence: tokens with ``pad_index``, targets with IGNORE."""

    def __init__(self, pad_index: int) -> None:
        self.pad_index = pad_index

    def __call__(self, batch):
        n = max(len(t) for t, _ in batch)
        tokens = torch.full((len(batch), n), self.pad_index, dtype=torch.int64)  # (B, n)
        targets = torch.full((len(batch), n), IGNORE_INDEX, dtype=torch.int64)  # (B, n)
        for row, (t, y) in enumerate(batch):
            tokens[row, : len(t)] = t
            targets[row, : len(y)] = y
        return tokens, targets


# --------------------------------------------------------------------------------------------
# arithmetic
# --------------------------------------------------------------------------------------------


def arithmetic_item(a: int, op: str, b: int, variant: str) -> tuple[list[int], list[int]]:
    """Tokens and targets of ``a op b``; the answer is sign + 3 digits (2 for single_digit)."""
    index = {tok: i for i, tok in enumerate(ARITHMETIC_TOKENS)}
    result = a + b if op == PLUS else a - b
    width = 3 if variant == "two_digit" else 2
    answer = [PLUS if result >= 0 else MINUS, *f"{abs(result):0{width}d}"]
    operand = (lambda v: f"{v:02d}") if variant == "two_digit" else str
    prompt = [*operand(a), op, *operand(b), EQUALS]
    tokens = [index[t] for t in prompt] + [index[SLOT]] * len(answer)
    targets = [IGNORE_INDEX] * len(prompt) + [index[t] for t in answer]
    return tokens, targets


def decode_arithmetic(tokens: Sequence[int]) -> str:
    return " ".join(ARITHMETIC_TOKENS[t] for t in tokens if t != 0)


def _split_counts(options: dict[str, Any], total: int) -> tuple[int, int, int]:
    counts = [int(options.get(k) or 0) for k in ("num_train", "num_val", "num_test")]
    if counts == [0, 0, 0]:
        n_train = int(round(SPLIT_FRACTIONS[0] * total))
        n_val = int(round(SPLIT_FRACTIONS[1] * total))
        return n_train, n_val, total - n_train - n_val
    if min(counts) < 0 or sum(counts) > total:
        raise DataError(
            f"arithmetic has {total} distinct expressions; num_train+num_val+num_test = "
            f"{sum(counts)} ({counts}) cannot be split without repeats: lower them, or set "
            "all three to 0 for the 80/10/10 split"
        )
    if 0 in counts:
        raise DataError(f"split sizes {counts} must all be positive (or all 0 for 80/10/10)")
    return counts[0], counts[1], counts[2]


def build_arithmetic(options: dict[str, Any]) -> DataBundle:
    variant = options.get("variant", "two_digit")
    if variant not in VARIANTS:
        raise DataError(f"data.variant={variant!r} is unknown for arithmetic; use {VARIANTS}")
    top = 100 if variant == "two_digit" else 10
    expressions = [(a, op, b) for a in range(top) for op in (PLUS, MINUS) for b in range(top)]
    order = np.random.default_rng(int(options.get("split_seed", 0))).permutation(len(expressions))
    n_train, n_val, n_test = _split_counts(options, len(expressions))
    chosen = [expressions[i] for i in order]
    parts = (
        chosen[:n_train],
        chosen[n_train : n_train + n_val],
        chosen[n_train + n_val : n_train + n_val + n_test],
    )
    train, val, test = (
        SequenceTask([arithmetic_item(a, op, b, variant) for a, op, b in part]) for part in parts
    )
    return _bundle(train, val, test, {}, ARITHMETIC_TOKENS)


# --------------------------------------------------------------------------------------------
# addition
# --------------------------------------------------------------------------------------------


def addition_item(
    a: str, b: str, *, reverse_answer: bool = True, causal: bool = False
) -> tuple[list[int], list[int]]:
    """Tokens and targets of ``a + b`` (decimal strings, most significant digit first).

    The answer has w = max(len a, len b) + 1 digits (zero-padded), least significant first
    when ``reverse_answer``. ``causal``: the answer positions hold ``_`` then answer digits
    1 … w−1 (teacher forcing); otherwise w slots ``_``.
    """
    index = {tok: i for i, tok in enumerate(ADDITION_TOKENS)}
    width = max(len(a), len(b)) + 1
    answer = list(f"{int(a) + int(b):0{width}d}")
    if reverse_answer:
        answer.reverse()
    prompt = [*a, PLUS, *b, EQUALS]
    shown = [SLOT, *answer[:-1]] if causal else [SLOT] * width
    tokens = [index[t] for t in prompt + shown]
    targets = [IGNORE_INDEX] * len(prompt) + [index[t] for t in answer]
    return tokens, targets


def _number(rng, digits: int) -> str:
    """A uniformly random decimal with exactly ``digits`` digits (0 allowed for one digit)."""
    first = int(rng.integers(0 if digits == 1 else 1, 10))
    rest = rng.integers(0, 10, size=digits - 1)
    return str(first) + "".join(str(int(d)) for d in rest)


def _draw_sums(rng, count, lengths, seed, lo, hi, what) -> list[tuple[str, str]]:
    """``count`` operand pairs, each length from ``lengths``, whose hash bucket is in [lo, hi)."""
    items, draws, limit = [], 0, 200 * count + 10_000
    while len(items) < count:
        draws += 1
        if draws > limit:
            raise DataError(
                f"could not draw {count} {what} additions of {lengths[0]}..{lengths[1]} digits "
                "that no other split contains; raise data.max_digits or lower the split sizes"
            )
        a = _number(rng, int(rng.integers(lengths[0], lengths[1] + 1)))
        b = _number(rng, int(rng.integers(lengths[0], lengths[1] + 1)))
        if lo <= _bucket(f"{a}+{b}".encode(), seed) < hi:
            items.append((a, b))
    return items


def _length_range(options, low_key, high_key, default_low, default_high, what):
    low = int(options.get(low_key) or 0) or default_low
    high = int(options.get(high_key) or 0) or max(low, default_high)
    if not 1 <= low <= high:
        raise DataError(
            f"data.{low_key}={low}, data.{high_key}={high}: {what} digit counts need "
            f"1 <= {low_key} <= {high_key}"
        )
    return low, high


def build_addition(options: dict[str, Any]) -> DataBundle:
    decoding = options.get("decoding", "one_pass")
    if decoding not in DECODINGS:
        raise DataError(f"data.decoding={decoding!r} is unknown for addition; use {DECODINGS}")
    train_len = _length_range(
        options, "min_digits", "max_digits", 1, 10, "training (and validation, test)"
    )
    long_len = _length_range(
        options, "test_min_len", "test_max_len", train_len[1] + 1, 3 * train_len[1], "test_long"
    )
    longer_len = _length_range(
        options,
        "test_longer_min_len",
        "test_longer_max_len",
        long_len[1] + 1,
        5 * train_len[1],
        "test_longer",
    )
    if long_len[0] <= train_len[1] or longer_len[0] <= train_len[1]:
        raise DataError(
            f"test_long ({long_len[0]}..{long_len[1]} digits) and test_longer "
            f"({longer_len[0]}..{longer_len[1]}) must start above data.max_digits="
            f"{train_len[1]}: raise data.test_min_len / data.test_longer_min_len"
        )
    counts = {k: int(options.get(k) or 0) for k in ("num_train", "num_val", "num_test")}
    counts["num_test_long"] = int(options.get("num_test_long") or counts["num_test"])
    counts["num_test_longer"] = int(options.get("num_test_longer") or counts["num_test"])
    fixed = {}  # test_100 / test_1000: operands of exactly that many digits
    for split, default in (("test_100", 100), ("test_1000", 1000)):
        digits = int(options.get(f"{split}_digits", default) or 0)
        if digits == 0:
            continue
        if digits <= train_len[1]:
            raise DataError(
                f"data.{split}_digits={digits} must be above data.max_digits={train_len[1]} "
                f"(or 0 to drop {split})"
            )
        fixed[split] = (digits, digits)
        counts[f"num_{split}"] = int(options.get(f"num_{split}") or 300)
    for key, value in counts.items():
        if value < 1:
            raise DataError(f"data.{key}={value} must be positive for addition")
    seed = int(options.get("split_seed", 0))
    rng = np.random.default_rng(seed)
    edges = np.cumsum((0.0, *SPLIT_FRACTIONS))
    whole = (0.0, 1.0)  # long splits: disjoint from training by their lengths
    pairs = {
        "train": _draw_sums(rng, counts["num_train"], train_len, seed, *edges[0:2], "train"),
        "val": _draw_sums(rng, counts["num_val"], train_len, seed, *edges[1:3], "val"),
        "test": _draw_sums(rng, counts["num_test"], train_len, seed, *edges[2:4], "test"),
        "test_long": _draw_sums(rng, counts["num_test_long"], long_len, seed, *whole, "test_long"),
        "test_longer": _draw_sums(
            rng, counts["num_test_longer"], longer_len, seed, *whole, "test_longer"
        ),
    }
    for split, lengths in fixed.items():  # drawn last: the other splits stay as they were
        pairs[split] = _draw_sums(rng, counts[f"num_{split}"], lengths, seed, *whole, split)
    reverse_answer = bool(options.get("reverse_answer", True))
    causal = decoding == "causal"
    data = {
        k: SequenceTask(
            [addition_item(a, b, reverse_answer=reverse_answer, causal=causal) for a, b in v]
        )
        for k, v in pairs.items()
    }
    extra = {k: v for k, v in data.items() if k.startswith("test_")}
    return _bundle(
        data["train"],
        data["val"],
        data["test"],
        extra,
        ADDITION_TOKENS,
        answer_order="lsd" if reverse_answer else "msd",
        causal_answer=causal,
    )


# --------------------------------------------------------------------------------------------
# sort / reverse
# --------------------------------------------------------------------------------------------


def symbol_tokens(num_symbols: int) -> tuple[str, ...]:
    return (PAD, SLOT, EQUALS, *DIGITS[:num_symbols])


def ordering_item(symbols: Sequence[int], task: str) -> tuple[list[int], list[int]]:
    """``s₁ … s_m = _ … _`` → sorted or reversed symbols at the slots (ids offset by 3)."""
    offset = 3  # PAD, SLOT, EQUALS come first
    answer = sorted(symbols) if task == "sort" else list(reversed(symbols))
    m = len(symbols)
    tokens = [s + offset for s in symbols] + [2] + [1] * m
    targets = [IGNORE_INDEX] * (m + 1) + [s + offset for s in answer]
    return tokens, targets


def _bucket(symbols: Sequence[int] | bytes, seed: int) -> float:
    """A seeded hash of the content in [0, 1): which split this sequence may belong to."""
    key = seed.to_bytes(8, "little", signed=True) + bytes(symbols)
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def _draw(rng, count, lengths, num_symbols, seed, lo, hi, what):
    items, draws, limit = [], 0, 200 * count + 10_000
    while len(items) < count:
        draws += 1
        if draws > limit:
            raise DataError(
                f"could not draw {count} {what} sequences of lengths {lengths[0]}..{lengths[1]} "
                f"over {num_symbols} symbols that no other split contains; raise num_symbols "
                "or the lengths, or lower the split sizes"
            )
        m = int(rng.integers(lengths[0], lengths[1] + 1))
        symbols = [int(s) for s in rng.integers(0, num_symbols, size=m)]
        if lo <= _bucket(symbols, seed) < hi:
            items.append(symbols)
    return items


def build_ordering(task: str, options: dict[str, Any]) -> DataBundle:
    num_symbols = int(options.get("num_symbols", 10))
    min_len, max_len = int(options.get("min_len", 4)), int(options.get("max_len", 8))
    test_min = int(options.get("test_min_len") or 0) or max_len + 1
    test_max = int(options.get("test_max_len") or 0) or max(test_min, 2 * max_len)
    if not 2 <= num_symbols <= len(DIGITS):
        raise DataError(f"data.num_symbols={num_symbols} must be between 2 and {len(DIGITS)}")
    if min_len < 1:
        raise DataError(f"data.min_len={min_len} must be at least 1")
    if min_len > max_len:
        raise DataError(
            f"data.min_len={min_len} is larger than data.max_len={max_len}; "
            f"set data.max_len >= {min_len} (or lower data.min_len)"
        )
    if test_min > test_max:
        raise DataError(
            f"data.test_min_len={test_min} is larger than data.test_max_len={test_max}; "
            f"set data.test_max_len >= {test_min}"
        )
    counts = {k: int(options.get(k) or 0) for k in ("num_train", "num_val", "num_test")}
    counts["num_test_long"] = int(options.get("num_test_long") or counts["num_test"])
    for key, value in counts.items():
        if value < 1:
            raise DataError(f"data.{key}={value} must be positive for {task}")
    seed = int(options.get("split_seed", 0))
    rng = np.random.default_rng(seed)
    edges = np.cumsum((0.0, *SPLIT_FRACTIONS))
    train_len = (min_len, max_len)
    long_len = (test_min, test_max)
    splits = {
        "train": _draw(
            rng, counts["num_train"], train_len, num_symbols, seed, *edges[0:2], "train"
        ),
        "val": _draw(rng, counts["num_val"], train_len, num_symbols, seed, *edges[1:3], "val"),
        "test": _draw(rng, counts["num_test"], train_len, num_symbols, seed, *edges[2:4], "test"),
        "test_long": _draw(
            rng, counts["num_test_long"], long_len, num_symbols, seed, *edges[2:4], "test_long"
        ),
    }
    data = {k: SequenceTask([ordering_item(s, task) for s in v]) for k, v in splits.items()}
    tokens = symbol_tokens(num_symbols)
    return _bundle(
        data["train"], data["val"], data["test"], {"test_long": data["test_long"]}, tokens
    )


def _bundle(
    train, val, test, extra, tokens, *, answer_order: str = "lsd", causal_answer: bool = False
) -> DataBundle:
    max_len = max(s.max_len for s in (train, val, test, *extra.values()))
    spec = DataSpec(
        task="tokens",
        num_classes=len(tokens),
        vocab_size=len(tokens),
        max_len=max_len,
        pad_index=0,
        arch="sequence",
        tokens=tuple(tokens),
        answer_order=answer_order,
        causal_answer=causal_answer,
    )
    return DataBundle(
        train=train, val=val, test=test, spec=spec, collate=PadCollate(0), extra_tests=extra
    )


def dataset(name: str, **options: Any) -> DataBundle:
    """``_target_`` of the sequence data configs: :func:`build` with the config's keys as
    keyword arguments."""
    return build(name, options, None)


def build(name: str, options: dict[str, Any], root: Path | None) -> DataBundle:
    """Generate dataset ``name`` (arithmetic, addition, sort, reverse); ``root`` is unused."""
    options = dict(options)
    if name == "arithmetic":
        return build_arithmetic(options)
    if name == "addition":
        return build_addition(options)
    if name in ("sort", "reverse"):
        return build_ordering(name, options)
    raise DataError(
        f"dataset {name!r} is not a sequence task; use arithmetic, addition, sort or reverse"
    )
