"""The knowledge-attention seq2seq model: exact invariance, permutation laws, configs."""

from __future__ import annotations

import pytest
import torch

from symattn_cli.data.base import DataSpec
from symattn_cli.errors import ConfigError
from symattn_cli.models import knowledge
from symattn_cli.models.knowledge import FORMS, build_model
from symattn_cli.verify.knowledge import (
    CLEAR_FAILURE,
    TOLERANCES,
    model_orthogonal_errors,
    model_permutation_error,
)
from tests.helpers import arithmetic_spec, build_on

TOL = TOLERANCES[torch.float64]


def build(options, spec):
    return build_on(knowledge.build, options, spec)


def default_spec(options):
    return arithmetic_spec()


SMALL = {"d_model": 8, "heads": 2, "layers": 2, "knowledge": 6, "mlp_hidden": 16}


def small_model(form: str, position: str = "footnote"):
    torch.manual_seed(0)
    return build_model(
        vocab_size=15, pad_index=0, max_len=12, form=form, position=position, **SMALL
    ).double()


def tokens(n: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 15, (3, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("form", sorted(FORMS))
def test_logits_invariant_under_embedding_and_knowledge_rotation(form):
    errors = model_orthogonal_errors(small_model(form), tokens(), samples=2)
    assert errors["with_knowledge"] <= TOL
    assert errors["embedding_only"] > CLEAR_FAILURE


@pytest.mark.parametrize("position", ["learned", "sinusoidal"])
def test_every_position_encoding_is_knowledge(position):
    errors = model_orthogonal_errors(small_model("softmax", position), tokens(), samples=2)
    assert errors["with_knowledge"] <= TOL


@pytest.mark.parametrize("form", ["softmax", "general", "perm"])
@pytest.mark.parametrize("convention", ["columns", "rows"])
def test_permutation_equivariant_without_position_only(form, convention):
    plain = small_model(form, position="none")
    assert model_permutation_error(plain, tokens(), convention=convention) <= TOL
    encoded = small_model(form, position="footnote")
    assert model_permutation_error(encoded, tokens(), convention=convention) > CLEAR_FAILURE


@pytest.mark.parametrize("position", ["footnote", "sinusoidal"])
def test_padding_is_masked(position):
    model = small_model("softmax", position)
    x = tokens()
    padded = torch.cat([x, torch.zeros(3, 4, dtype=torch.int64)], dim=1)  # (B, n + 4)
    with torch.no_grad():
        assert torch.allclose(model(padded)[:, : x.shape[1]], model(x), atol=1e-12)


def test_registry_builder_and_default_spec():
    spec = default_spec({})
    model = build({"form": "rbf", **SMALL}, spec)
    assert model(tokens(n=10)).shape == (3, 10, spec.vocab_size)
    with pytest.raises(ConfigError, match="form='cubic'"):
        build({"form": "cubic"}, spec)
    with pytest.raises(ConfigError, match="position='rotary'"):
        build({"position": "rotary"}, spec)
    import symattn_cli

    with pytest.raises(ConfigError, match=r"model.vocab_size: .*data.vocab_size"):
        symattn_cli.create_model("ka_softmax", data="rotmnist_mini")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"form": "perm", "g_hidden": 0}, "model.g_hidden=0"),
        ({"form": "perm", "g_features": 0}, "model.g_features=0"),
        ({"form": "general", "g_hidden": -1}, "model.g_hidden=-1"),
        ({"knowledge": -2}, "model.knowledge=-2"),
        ({"value_dim": -1}, "model.value_dim=-1"),
        ({"mlp_hidden": -8}, "model.mlp_hidden=-8"),
    ],
)
def test_sizes_that_cannot_build_are_refused_by_name(options, message):
    with pytest.raises(ConfigError, match=message):
        build(options, default_spec({}))
    if "g_" in message:  # the width is only read by the forms with networks of invariants
        assert build({**options, "form": "softmax", **SMALL}, default_spec({})) is not None


@pytest.mark.parametrize(
    "name",
    ["ka_softmax", "ka_sigmoid", "ka_kernel", "ka_rbf", "ka_quartic", "ka_general", "ka_perm"],
)
def test_yaml_models_build(name):
    from symattn_cli.models.instantiate import create_model

    model = create_model(name)
    out = model(tokens(n=10))
    assert out.shape == (3, 10, 15) and torch.isfinite(out).all()


# --------------------------------------------------------------------------------------------
# Positions as knowledge (coupled, abacus) and causal answers
# --------------------------------------------------------------------------------------------


def addition_model(position: str, *, causal: bool = False, form: str = "softmax", **extra):
    from symattn_cli.verify.knowledge import addition_example

    example, spec = addition_example(causal=causal)
    torch.manual_seed(0)
    model = build({"form": form, "position": position, **SMALL, **extra}, spec).double()
    return model.eval(), example, spec


def test_coupled_index_is_significance_shared_by_operands_and_answer():
    from symattn_cli.data.sequences import ADDITION_TOKENS, addition_item
    from symattn_cli.models.knowledge import coupled_index

    digits = torch.tensor([t.isdigit() for t in ADDITION_TOKENS])
    items = [addition_item("473", "5", reverse_answer=r) for r in (True, False)]
    tokens = torch.tensor([items[0][0], items[1][0]])  # "4 7 3 + 5 = _ _ _ _"
    lsd = coupled_index(tokens[:1], digits=digits, slot=1, pad=0, answer_order="lsd")
    msd = coupled_index(tokens[1:], digits=digits, slot=1, pad=0, answer_order="msd")
    assert lsd[0].tolist() == [3, 2, 1, 0, 1, 0, 1, 2, 3, 4]
    assert msd[0].tolist() == [3, 2, 1, 0, 1, 0, 4, 3, 2, 1]
    # sort / reverse: answer slot t is coupled with input symbol m + 1 - t (reverse's source)
    rev = torch.tensor([[5, 6, 7, 2, 1, 1, 1, 0]])  # s₁ s₂ s₃ = _ _ _ <pad>
    digits = torch.tensor([False] * 3 + [True] * 10)
    got = coupled_index(rev, digits=digits, slot=1, pad=0, answer_order="lsd")
    assert got[0].tolist() == [3, 2, 1, 0, 1, 2, 3, 0]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("position", ["coupled", "abacus"])
def test_indexed_positions_are_knowledge_and_seen(position, causal):
    from symattn_cli.verify.knowledge import position_shift_change

    model, example, _ = addition_model(position, causal=causal)
    errors = model_orthogonal_errors(model, example, samples=2)
    assert errors["with_knowledge"] <= TOL
    assert errors["embedding_only"] > CLEAR_FAILURE
    assert position_shift_change(model, example) > CLEAR_FAILURE  # not blind to positions


def test_abacus_offset_is_random_in_training_only():
    model, example, spec = addition_model("abacus", position_offset=20)
    assert model.position_offset == 20
    assert model.position.table.shape[0] == spec.max_len + 20 + 1
    fixed = model.layout(example).index
    torch.manual_seed(1)
    shifted = model.train().layout(example).index
    moved = (shifted - fixed)[fixed > 0]
    offsets = (shifted - fixed).max(-1).values  # (B,): one offset per sequence
    assert ((shifted - fixed) == offsets[:, None] * (fixed > 0)).all()
    assert moved.min() >= 0 and moved.max() <= 20 and len(set(offsets.tolist())) > 1
    assert (shifted[fixed == 0] == 0).all()  # operators and padding keep no position


def test_causal_answers_read_no_later_token_and_decode_greedily():
    from symattn_cli.verify.knowledge import causal_leak

    model, example, _ = addition_model("coupled", causal=True)
    assert causal_leak(model, example) == 0.0
    model.causal = False  # the same weights reading every token: the check must fail
    assert causal_leak(model, example) > CLEAR_FAILURE
    model.causal = True
    with torch.no_grad():
        greedy = model(example)  # (B, n, V): evaluation decodes greedily
        layout = model.layout(example)
        answer = layout.answer
        follows = answer & torch.roll(answer, 1, dims=1)
        fed = torch.where(follows, torch.roll(greedy.argmax(-1), 1, dims=1), example)
        assert not torch.equal(fed[answer], example[answer])  # not the data's answers
        forced = model.logits(fed, layout)  # teacher forcing on its own predictions
    assert torch.allclose(greedy[answer], forced[answer], atol=1e-12)
    # training mode: one teacher-forced pass on the data's tokens
    assert torch.allclose(model.train()(example), model.logits(example, layout), atol=1e-12)


def test_indexed_positions_and_causal_answers_refuse_what_they_cannot_do():
    with pytest.raises(ConfigError, match="form='quartic' sums over all tokens"):
        addition_model("coupled", causal=True, form="quartic")
    with pytest.raises(ConfigError, match="position=coupled indexes digits"):
        build({"position": "coupled"}, DataSpec(task="tokens", num_classes=4, tokens=("a",)))
    with pytest.raises(ConfigError, match="position_offset=-2"):
        addition_model("abacus", position_offset=-2)
    model, example, _ = addition_model("abacus")
    with pytest.raises(ValueError, match="exceeds the table"):
        model(example, position_shift=1000)


# --------------------------------------------------------------------------------------------
# Relative index scores
# --------------------------------------------------------------------------------------------


def test_relative_buckets_clip_index_differences_and_set_operators_apart():
    from symattn_cli.models.knowledge import relative_buckets

    index = torch.tensor([[3, 2, 1, 0, 1, 0, 1, 2, 3, 4]])  # 473 + 5 = _ _ _ _
    answer = torch.tensor([[False] * 6 + [True] * 4])
    # (1, n, n): c_i − c_j ∈ [−2, 2] → 0..4, + 5·(2·[query in answer] + [key in answer]); 20
    buckets = relative_buckets(index, answer, 2)
    assert buckets[0, 6].tolist() == [14, 13, 12, 20, 12, 20, 17, 18, 19, 19]  # answer, c = 1
    assert buckets[0, 3].tolist() == [20] * 10  # query '+': no index
    assert buckets[0, 9, 0].item() == 11 and buckets[0, 0, 9].item() == 8  # 3 − 4, 4 − 3


@pytest.mark.parametrize("form", ["softmax", "sigmoid", "kernel", "rbf"])
def test_relative_index_scores_are_invariant_translation_free_and_seen(form):
    from symattn_cli.verify.knowledge import position_shift_change

    model, example, _ = addition_model("abacus", causal=True, form=form, relative_span=2)
    for block in model.blocks:
        torch.nn.init.normal_(block.attention.relative_bias)
    errors = model_orthogonal_errors(model, example, samples=2)
    assert errors["with_knowledge"] <= TOL and errors["embedding_only"] > CLEAR_FAILURE
    with torch.no_grad():
        model.position.frame.zero_()  # positions reach the model through the relative term only
        assert position_shift_change(model, example) <= TOL  # a function of differences only
        before = model(example)
        for block in model.blocks:
            block.attention.relative_bias.zero_()
        assert (model(example) - before).norm() / before.norm() > CLEAR_FAILURE  # it is read


@pytest.mark.parametrize("position", ["coupled", "abacus", "relative"])
def test_relative_index_changes_measure_translation_and_use(position):
    from symattn_cli.verify.knowledge import relative_index_changes

    model, example, _ = addition_model(position, causal=True, relative_span=3)
    assert (model.position is None) == (position == "relative")
    errors = model_orthogonal_errors(model, example, samples=2)
    assert errors["with_knowledge"] <= TOL and errors["embedding_only"] > CLEAR_FAILURE
    assert relative_index_changes(model, example)["removed"] == 0.0  # zero at the start
    for block in model.blocks:
        torch.nn.init.normal_(block.attention.relative_bias)
    changes = relative_index_changes(model, example)
    assert changes["shift"] <= TOL and changes["removed"] > CLEAR_FAILURE


def test_relative_window_reads_indexed_keys_within_the_span_only():
    model, example, _ = addition_model("abacus", causal=True, relative_span=1, relative_window=True)
    weights = []
    for block in model.blocks:
        block.attention.coefficients.register_forward_hook(lambda m, a, out: weights.append(out))
    with torch.no_grad():
        layout = model.layout(example)
        model.logits(example, layout)
    c = layout.index  # (B, n)
    indexed = (c[:, None, :] > 0) & (c[:, :, None] > 0)  # (B, n_j, n_i)
    far = indexed & ((c[:, None, :] - c[:, :, None]).abs() > 1)
    near = indexed & ~far & layout.attend
    assert far.any() and near.any()
    for a in weights:  # (B, h, n, n)
        assert (a.permute(1, 0, 2, 3)[:, far] == 0).all()
        assert (a.permute(1, 0, 2, 3)[:, near] > 0).all()
    unwindowed, _, _ = addition_model("abacus", causal=True, relative_span=1)
    assert (unwindowed.layout(example).attend.expand_as(far)[far]).any()  # masked by the window


@pytest.mark.parametrize("causal", [False, True])
def test_window_rows_list_exactly_the_dense_pairs_and_buckets(causal):
    model, example, _ = addition_model("coupled", causal=causal, relative_span=2,
                                       relative_window=True)  # fmt: skip
    dense = model.layout(example, windowed=False)
    windowed = model.layout(example, windowed=True)
    assert windowed.rows is not None and windowed.attend.dim() == 2  # no (B, n, n) mask
    assert windowed.buckets is None
    bsz, n = example.shape
    listed = torch.zeros(bsz, n, n, dtype=torch.long)  # how often each pair is listed
    buckets = torch.full((bsz, n, n), -1)
    for part in windowed.rows:
        b = torch.arange(bsz)[:, None, None].expand_as(part.keys)
        q = part.query[..., None].expand_as(part.keys)
        listed.index_put_((b[part.valid], q[part.valid], part.keys[part.valid]),
                          torch.tensor(1), accumulate=True)  # fmt: skip
        buckets[b[part.valid], q[part.valid], part.keys[part.valid]] = part.buckets[part.valid]
    real = example != 0
    want = dense.attend.expand(bsz, n, n) & real[:, :, None]  # pairs of real queries
    assert listed.max() == 1 and torch.equal(listed.bool(), want)
    assert torch.equal(buckets[want], dense.buckets[want])


@pytest.mark.parametrize("causal", [False, True])
def test_windowed_evaluation_equals_the_dense_one(causal):
    from symattn_cli.verify.knowledge import windowed_dense_error

    model, example, _ = addition_model("coupled", causal=causal, relative_span=2,
                                       relative_window=True)  # fmt: skip
    for block in model.blocks:
        torch.nn.init.normal_(block.attention.relative_bias)
    assert windowed_dense_error(model, example) <= TOL
    with torch.no_grad():  # the default in evaluation; greedy answers moved by the decoding
        assert torch.equal(model(example), model(example, windowed=True))
        real = example != 0
        shifted = model(example, windowed=True, position_shift=1)[real]
        assert (shifted - model(example, windowed=True)[real]).abs().max() > CLEAR_FAILURE
    with pytest.raises(ValueError, match="windowed=True needs"):
        addition_model("coupled", causal=causal)[0](example, windowed=True)


@pytest.mark.slow
def test_windowed_decoding_is_greedy_at_a_thousand_digits():
    from symattn_cli.verify.knowledge import long_addition_example, model_orthogonal_errors

    _, _, spec = addition_model("coupled", causal=True)
    torch.manual_seed(0)
    model = build({"form": "softmax", "position": "coupled", "relative_span": 3,
                   "relative_window": True, **SMALL}, spec).double().eval()  # fmt: skip
    example = long_addition_example(1000, count=1)  # (1, 3003)
    with torch.no_grad():
        greedy = model(example)  # (1, n, V)
        layout = model.layout(example, windowed=True)
        answer = layout.answer
        follows = answer & torch.roll(answer, 1, dims=1)
        fed = torch.where(follows, torch.roll(greedy.argmax(-1), 1, dims=1), example)
        forced = model.logits(fed, layout)  # one pass, teacher-forced on its own answers
    assert torch.allclose(greedy[answer], forced[answer], atol=1e-12)
    assert model_orthogonal_errors(model, example, samples=1)["with_knowledge"] <= TOL


def test_relative_index_scores_refuse_what_they_cannot_do():
    with pytest.raises(ConfigError, match="relative_span=2 scores differences"):
        build_model(vocab_size=15, pad_index=0, max_len=12, relative_span=2, **SMALL)
    with pytest.raises(ConfigError, match="form=general has no single score"):
        addition_model("coupled", form="general", relative_span=2)
    with pytest.raises(ConfigError, match="position=relative reads positions through"):
        addition_model("relative")
    with pytest.raises(ConfigError, match="relative_window=true reads each digit's window"):
        addition_model("abacus", relative_window=True)
    with pytest.raises(ConfigError, match="relative_window=true.*model.form=quartic"):
        addition_model("abacus", form="quartic", relative_span=2, relative_window=True)
    with pytest.raises(ConfigError, match="relative_span=-1 must be >= 0"):
        addition_model("coupled", relative_span=-1)
