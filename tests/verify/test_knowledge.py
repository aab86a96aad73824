"""Knowledge-attention checks as library functions, incl. embedding transfer after training."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from symattn_cli.data.base import IGNORE_INDEX
from symattn_cli.data.sequences import build
from symattn_cli.models.knowledge import build_model
from symattn_cli.verify.knowledge import (
    TOLERANCES,
    embedding_transfer,
    fixed_embedding_violation,
    haar_orthogonal,
    random_permutation,
)
from tests.helpers import threads

TOL = TOLERANCES[torch.float64]


def test_fixed_embedding_task_is_not_orthogonal_equivariant():
    # Ma & Ying Sec. 3.2: swapping e₊ and e₋ maps "2 + 1" to "2 − 1", yet Q f(X) ≠ f(QX)
    assert fixed_embedding_violation() > 0.5


def test_haar_and_permutation_samples():
    gen = torch.Generator().manual_seed(0)
    q = haar_orthogonal(7, gen)
    assert torch.allclose(q.T @ q, torch.eye(7, dtype=q.dtype), atol=1e-12)
    p = random_permutation(5, gen)
    assert torch.equal(p.sum(0), torch.ones(5, dtype=p.dtype)) and not torch.equal(p, torch.eye(5))


@pytest.fixture
def one_thread():
    """Train on one thread: tiny models run several times faster on a shared CPU."""
    with threads(1):
        yield


def _train_tiny(bundle, steps: int = 500):
    torch.manual_seed(0)
    model = build_model(
        vocab_size=bundle.spec.vocab_size,
        pad_index=bundle.spec.pad_index,
        max_len=bundle.spec.max_len,
        d_model=16,
        heads=2,
        layers=1,
        mlp_hidden=64,
        position="learned",
    )
    loader = DataLoader(bundle.train, batch_size=32, shuffle=True, collate_fn=bundle.collate)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = 0
    while step < steps:
        for tokens, targets in loader:
            logits = model(tokens)  # (B, n, V)
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
    return model


def test_embedding_transfer_on_a_trained_model(one_thread):
    bundle = build("arithmetic", {"variant": "single_digit"}, None)
    model = _train_tiny(bundle)
    batches = DataLoader(bundle.train, batch_size=64, collate_fn=bundle.collate)
    result = embedding_transfer(model, batches, seed=3)
    assert result["token_acc"] > 0.85  # it learned the (memorised) single-digit sums
    # embedding and knowledge rotated together: the very same predictions
    assert result["rotated_token_acc"] == result["token_acc"]
    assert result["rotated_exact_acc"] == result["exact_acc"]
    assert result["agreement"] == 1.0
    assert result["logit_error"] <= TOL
    # embedding rotated alone: the trained knowledge no longer reads it
    assert result["embedding_only_token_acc"] < result["token_acc"] - 0.3
    assert result["embedding_only_exact_acc"] < 0.1
    assert all(isinstance(v, float) for v in result.values())


@pytest.mark.slow  # greedy decodings in float64: tens of seconds
def test_suite_checks_indexed_positions_and_causal_answers():
    from symattn_cli.verify.suite import indexed_position_checks

    rows = indexed_position_checks(dtype="float64", seed=0)
    # {coupled, abacus} × {one pass: 3 checks, causal: 4}; abacus + relative term: 4;
    # the window over listed pairs: equal to the dense one, then 3 checks at 40 digits
    assert len(rows) == 22
    assert {r.verdict for r in rows} == {"pass", "fails as expected"}
    for row in rows:
        if row.expect == "exact":
            assert row.rel_err <= TOL, row
        else:  # embedding rotated alone; position indices moved: the output must change
            assert row.rel_err > 1e-2, row
    shifted = [r for r in rows if "non-degeneracy" in r.element]
    assert len(shifted) == 6 and {r.symmetry for r in shifted} == {"positions"}
    window = [r for r in rows if "40 digits" in r.layer or r.symmetry == "window"]
    assert [r.expect for r in window] == ["exact", "exact", "violation", "violation"]
    assert sum(r.symmetry == "causality" and r.rel_err == 0.0 for r in rows) == 2


class _Oracle(torch.nn.Module):
    """Answers additions from their tokens, wrong at digit ``wrong_at`` of every ``every``-th."""

    def __init__(self, wrong_at: int, every: int):
        super().__init__()
        self.wrong_at, self.every, self.calls = wrong_at, every, 0

    def forward(self, tokens):
        from symattn_cli.data.sequences import ADDITION_TOKENS, addition_item

        logits = torch.zeros(*tokens.shape, len(ADDITION_TOKENS), dtype=torch.float64)
        for row, seq in enumerate(tokens.tolist()):
            text = "".join(ADDITION_TOKENS[t] for t in seq if t != 0)
            a, b = text[: text.index("=")].split("+")
            _, targets = addition_item(a, b, causal=True)
            answer = [i for i, t in enumerate(targets) if t != IGNORE_INDEX]
            if self.calls % self.every == 0:
                targets[answer[self.wrong_at - 1]] = (targets[answer[self.wrong_at - 1]] + 1) % 14
            self.calls += 1
            for pos, t in enumerate(targets):
                logits[row, pos, max(t, 0)] = 1.0
        return logits


def test_addition_length_profile_counts_exact_answers_and_first_wrong_digits():
    from symattn_cli.verify.knowledge import addition_length_profile

    profile = addition_length_profile(_Oracle(wrong_at=7, every=4), [12, 30], count=8,
                                      batch_size=3)  # fmt: skip
    assert [p["digits"] for p in profile] == [12, 30]
    assert [p["exact"] for p in profile] == [0.75, 0.75]  # 2 of 8 wrong each
    assert [p["first_wrong"] for p in profile] == [[7, 7], [7, 7]]
