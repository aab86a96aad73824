"""Generated sequence tasks: sizes, disjoint splits, correct answers, lengths, errors."""

from __future__ import annotations

import pytest

from symattn_cli.data.base import IGNORE_INDEX, DataError
from symattn_cli.data.sequences import ARITHMETIC_TOKENS, build

SMALL = {"num_train": 400, "num_val": 60, "num_test": 60, "min_len": 2, "max_len": 6}


def _keys(split):
    return {tuple(tokens.tolist()) for tokens, _ in split}


def _answer_tokens(targets):
    return [t for t in targets.tolist() if t != IGNORE_INDEX]


def test_arithmetic_default_split_and_answers():
    bundle = build("arithmetic", {}, None)
    assert (len(bundle.train), len(bundle.val), len(bundle.test)) == (16000, 2000, 2000)
    keys = [_keys(s) for s in (bundle.train, bundle.val, bundle.test)]
    assert sum(map(len, keys)) == 20000  # every expression once, no leak across splits
    spec = bundle.spec
    assert spec.task == "tokens" and spec.vocab_size == 15 and spec.max_len == 10
    assert spec.tokens == ARITHMETIC_TOKENS and spec.pad_index == 0
    for tokens, targets in list(bundle.test)[:300]:
        text = [ARITHMETIC_TOKENS[t] for t in tokens.tolist()]
        assert text[5] == "=" and text[6:] == ["_"] * 4
        a, b = int("".join(text[0:2])), int("".join(text[3:5]))
        value = a + b if text[2] == "+" else a - b
        answer = "".join(ARITHMETIC_TOKENS[t] for t in _answer_tokens(targets))
        assert answer == ("+" if value >= 0 else "-") + f"{abs(value):03d}"
        assert (targets[:6] == IGNORE_INDEX).all()


def test_arithmetic_single_digit_variant_and_determinism():
    bundle = build("arithmetic", {"variant": "single_digit"}, None)
    assert (len(bundle.train), len(bundle.val), len(bundle.test)) == (160, 20, 20)
    tokens, targets = bundle.train[0]
    assert len(tokens) == len(targets) == 7
    again = build("arithmetic", {"variant": "single_digit"}, None)
    assert _keys(again.test) == _keys(bundle.test)
    other = build("arithmetic", {"variant": "single_digit", "split_seed": 1}, None)
    assert _keys(other.test) != _keys(bundle.test)


@pytest.mark.parametrize("task", ["sort", "reverse"])
def test_ordering_tasks(task):
    bundle = build(task, SMALL, None)
    train, val, test = _keys(bundle.train), _keys(bundle.val), _keys(bundle.test)
    long = _keys(bundle.extra_tests["test_long"])
    assert not (train & val) and not (train & test) and not (val & test) and not (train & long)
    for tokens, targets in bundle.train:
        m = (len(tokens) - 1) // 2
        assert 2 <= m <= 6 and len(targets) == len(tokens)
        symbols = tokens[:m].tolist()
        want = sorted(symbols) if task == "sort" else symbols[::-1]
        assert _answer_tokens(targets) == want
    lengths = {(len(t) - 1) // 2 for t, _ in bundle.extra_tests["test_long"]}
    assert min(lengths) == 7 and max(lengths) <= 12  # defaults: max_len + 1 .. 2 * max_len
    assert bundle.spec.max_len == max(len(t) for t, _ in bundle.extra_tests["test_long"])
    assert _keys(build(task, SMALL, None).test) == test  # deterministic from the seed


def test_collate_pads_tokens_and_targets():
    bundle = build("sort", SMALL, None)
    batch = [bundle.train[i] for i in range(8)]
    tokens, targets = bundle.collate(batch)
    n = max(len(t) for t, _ in batch)
    assert tokens.shape == targets.shape == (8, n)
    for row, (t, _) in enumerate(batch):
        assert (tokens[row, len(t) :] == bundle.spec.pad_index).all()
        assert (targets[row, len(t) :] == IGNORE_INDEX).all()


@pytest.mark.parametrize(
    "options, message",
    [
        ({**SMALL, "min_len": 7, "max_len": 3}, "min_len=7 is larger than data.max_len=3"),
        ({**SMALL, "num_symbols": 40}, "num_symbols=40"),
        ({**SMALL, "test_min_len": 9, "test_max_len": 8}, "test_min_len=9"),
    ],
)
def test_bad_options_raise_data_errors(options, message):
    with pytest.raises(DataError, match=message):
        build("sort", options, None)


def test_bad_arithmetic_options():
    with pytest.raises(DataError, match="variant='three_digit'"):
        build("arithmetic", {"variant": "three_digit"}, None)
    with pytest.raises(DataError, match="200 distinct expressions"):
        build(
            "arithmetic",
            {"variant": "single_digit", "num_train": 500, "num_val": 1, "num_test": 1},
            None,
        )


ADDITION = {"num_train": 300, "num_val": 50, "num_test": 50, "max_digits": 6,
            "num_test_100": 4, "num_test_1000": 2}  # fmt: skip


def _addition_text(tokens, targets):
    from symattn_cli.data.sequences import ADDITION_TOKENS

    text = "".join(ADDITION_TOKENS[t] for t in tokens.tolist())
    prompt = text[: text.index("=")]
    a, b = prompt.split("+")
    answer = "".join(ADDITION_TOKENS[t] for t in _answer_tokens(targets))
    return a, b, text[len(prompt) + 1 :], answer


@pytest.mark.parametrize("reverse_answer", [True, False])
def test_addition_answers_lengths_and_disjoint_splits(reverse_answer):
    bundle = build("addition", {**ADDITION, "reverse_answer": reverse_answer}, None)
    splits = {"train": bundle.train, "val": bundle.val, "test": bundle.test}
    splits.update(bundle.extra_tests)
    assert list(bundle.extra_tests) == ["test_long", "test_longer", "test_100", "test_1000"]
    digits = {"train": (1, 6), "val": (1, 6), "test": (1, 6)}
    digits.update({"test_long": (7, 18), "test_longer": (19, 30)})  # 3x and 5x max_digits
    digits.update({"test_100": (100, 100), "test_1000": (1000, 1000)})
    for name, split in splits.items():
        seen = set()
        for tokens, targets in split:
            a, b, shown, answer = _addition_text(tokens, targets)
            lo, hi = digits[name]
            assert lo <= len(a) <= hi and lo <= len(b) <= hi, (name, a, b)
            assert a == str(int(a)) and b == str(int(b))  # no leading zeros
            width = max(len(a), len(b)) + 1
            want = f"{int(a) + int(b):0{width}d}"
            assert answer == (want[::-1] if reverse_answer else want)
            assert shown == "_" * width  # one pass: every answer position is a slot
            seen |= {len(a), len(b)}
        assert max(seen) == digits[name][1] and min(seen) == digits[name][0], name
    keys = [_keys(s) for s in (bundle.train, bundle.val, bundle.test)]
    assert not (keys[0] & keys[1]) and not (keys[0] & keys[2]) and not (keys[1] & keys[2])
    spec = bundle.spec
    assert spec.answer_order == ("lsd" if reverse_answer else "msd") and not spec.causal_answer
    assert spec.max_len == 2 * 1000 + 2 + 1001  # test_1000: operands, '+', '=', answer


def test_addition_fixed_length_splits_are_seeded_sized_and_optional():
    options = {**ADDITION, "num_test_100": 7, "num_test_1000": 3}
    bundle = build("addition", options, None)
    assert (len(bundle.extra_tests["test_100"]), len(bundle.extra_tests["test_1000"])) == (7, 3)
    again = build("addition", options, None)
    other = build("addition", {**options, "split_seed": 1}, None)
    for name in ("test_100", "test_1000"):
        assert _keys(bundle.extra_tests[name]) == _keys(again.extra_tests[name])
        assert not _keys(bundle.extra_tests[name]) & _keys(other.extra_tests[name])
    # drawn after the other splits: adding or dropping them leaves those unchanged
    dropped = build("addition", {**options, "test_100_digits": 0, "test_1000_digits": 0}, None)
    assert list(dropped.extra_tests) == ["test_long", "test_longer"]
    for name in ("test_long", "test_longer"):
        assert _keys(dropped.extra_tests[name]) == _keys(bundle.extra_tests[name])
    assert _keys(dropped.train) == _keys(bundle.train)
    assert dropped.spec.max_len == max(len(t) for t, _ in dropped.extra_tests["test_longer"])
    wide = build("addition", {**options, "test_100_digits": 40, "num_test_100": 2}, None)
    for tokens, targets in wide.extra_tests["test_100"]:
        a, b, _, answer = _addition_text(tokens, targets)
        assert len(a) == len(b) == 40 and answer == str(int(a) + int(b)).zfill(41)[::-1]
    with pytest.raises(DataError, match="test_1000_digits=6 must be above data.max_digits=6"):
        build("addition", {**options, "test_1000_digits": 6}, None)


def test_addition_causal_answers_hold_the_previous_digit():
    bundle = build("addition", {**ADDITION, "decoding": "causal"}, None)
    assert bundle.spec.causal_answer
    for tokens, targets in list(bundle.train)[:50]:
        _, _, shown, answer = _addition_text(tokens, targets)
        assert shown == "_" + answer[:-1]  # teacher forcing: the answer shifted by one


def test_addition_is_deterministic_and_checks_its_options():
    assert _keys(build("addition", ADDITION, None).test) == _keys(
        build("addition", ADDITION, None).test
    )
    with pytest.raises(DataError, match="decoding='beam'"):
        build("addition", {**ADDITION, "decoding": "beam"}, None)
    with pytest.raises(DataError, match="must start above data.max_digits=6"):
        build("addition", {**ADDITION, "test_min_len": 5}, None)
    with pytest.raises(DataError, match="min_digits=7"):
        build("addition", {**ADDITION, "min_digits": 7}, None)
