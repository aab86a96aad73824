"""Knowledge-attention layers: transformation laws, identities and sizes (float64)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from symattn_cli.models.knowledge import FORMS, make_coefficients
from symattn_cli.nn.knowledge import (
    KnowledgeAttention,
    KnowledgeBlock,
    PositionwiseMLP,
    ScalarRMSNorm,
    SinusoidPosition,
    rotate_embedding,
    sinusoid_table,
)
from symattn_cli.verify.knowledge import (
    CLEAR_FAILURE,
    TOLERANCES,
    attention_identity_error,
    haar_orthogonal,
    layer_orthogonal_errors,
    permutation_error,
    relative_error,
    remark41_errors,
)

TOL = TOLERANCES[torch.float64]
D, H, K = 8, 2, 6


def make_layer(form: str, *, external: int = 0, knowledge: int = K) -> KnowledgeAttention:
    torch.manual_seed(0)
    coef = make_coefficients(form=form, heads=H, knowledge=knowledge + external, d_model=D)
    return KnowledgeAttention(
        d_model=D,
        heads=H,
        knowledge=knowledge,
        external=external,
        value_dim=4,
        coefficients=coef,
    ).double()


def sample(n: int = 5, batch: int = 2, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, n, D, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_orthogonal_equivariance_with_knowledge(form):
    layer = make_layer(form)
    x = sample()
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    errors = layer_orthogonal_errors(layer, x, mask=mask)
    assert errors["with_knowledge"] <= TOL
    assert errors["input_only"] > CLEAR_FAILURE  # rotating X alone breaks it (Sec. 3.2)


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("convention", ["columns", "rows"])
def test_permutation_equivariance(form, convention):
    layer = make_layer(form)
    assert permutation_error(layer, sample(), convention=convention) <= TOL


@pytest.mark.parametrize("form", ["softmax", "general"])
def test_external_knowledge_moves_with_q(form):
    layer = make_layer(form, external=3, knowledge=3)
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(2, 3, D, generator=gen, dtype=torch.float64)  # (B, m, d)
    errors = layer_orthogonal_errors(layer, sample(), knowledge=z)
    assert errors["with_knowledge"] <= TOL
    assert errors["input_only"] > CLEAR_FAILURE
    with pytest.raises(ValueError, match="external knowledge of 3"):
        layer(sample(), None, z[:, :2])


def test_standard_attention_is_the_knowledge_form():
    assert attention_identity_error() <= TOL


def test_remark41_rho_psi_reproduce_softmax_attention():
    errors = remark41_errors()
    assert errors["corrected"] <= TOL
    assert errors["layer"] <= TOL
    assert errors["as_printed"] > CLEAR_FAILURE  # the printed remark misses the self term


@pytest.mark.parametrize("form", sorted(FORMS))
def test_parameter_count_does_not_depend_on_n(form):
    layer = make_layer(form)
    before = sum(p.numel() for p in layer.parameters())
    for n in (2, 7, 13):
        assert layer(sample(n=n)).shape == (2, n, D)
    assert sum(p.numel() for p in layer.parameters()) == before


def test_block_norm_and_mlp_laws():
    torch.manual_seed(0)
    block = KnowledgeBlock(
        attention=make_layer("softmax"),
        mlp=PositionwiseMLP(d_model=D, hidden=16, activation=torch.tanh),
        norm=ScalarRMSNorm,
    ).double()
    errors = layer_orthogonal_errors(block, sample())
    assert errors["with_knowledge"] <= TOL
    assert errors["input_only"] > CLEAR_FAILURE
    assert permutation_error(block, sample(), convention="columns") <= TOL


def test_layernorm_is_not_rotation_equivariant_but_scalar_rms_is():
    x = sample()
    q = haar_orthogonal(D, torch.Generator().manual_seed(0))
    rms = ScalarRMSNorm().double()
    assert relative_error(rms(x @ q.T), rms(x) @ q.T) <= TOL
    ln = nn.LayerNorm(D).double()
    assert relative_error(ln(x @ q.T), ln(x) @ q.T) > CLEAR_FAILURE


def test_undeclared_parameters_refuse_rotation():
    model = nn.Sequential(nn.Linear(D, D))
    with pytest.raises(TypeError, match="embedding_axes"):
        rotate_embedding(model, torch.eye(D))


def test_footnote_position_encoding_as_written():
    n, w = 6, 8
    table = sinusoid_table(torch.tensor([n, 4]), n, w, base=None).double()  # (2, n, w)
    for j in range(1, n + 1):
        for i in range(1, w // 2 + 1):
            angle = j / n ** (2 * i / w)
            assert table[0, j - 1, 2 * i - 2] == pytest.approx(math.sin(angle), abs=1e-12)
            assert table[0, j - 1, 2 * i - 1] == pytest.approx(math.cos(angle), abs=1e-12)
    # the second sequence has length 4: its own base, zeros on padding
    assert table[1, 0, 0] == pytest.approx(math.sin(1 / 4 ** (2 / w)), abs=1e-12)
    assert torch.all(table[1, 4:] == 0)


def test_usual_sinusoid_base():
    table = sinusoid_table(torch.tensor([5]), 5, 4, base=10000.0)  # (1, 5, 4)
    assert table[0, 3, 2] == pytest.approx(math.sin(3 / 10000 ** (2 / 4)), abs=1e-6)
    assert table[0, 3, 1] == pytest.approx(math.cos(3.0), abs=1e-6)


def test_position_frame_rotates_with_the_embedding():
    pos = SinusoidPosition(d_model=D, width=D, base=None).double()
    q = haar_orthogonal(D, torch.Generator().manual_seed(2))
    lengths = torch.tensor([5, 3])
    rotated = rotate_embedding(pos, q)
    assert relative_error(rotated(lengths, 5), pos(lengths, 5) @ q.T) <= TOL


@pytest.mark.parametrize("kind", ["sinusoid", "table"])
def test_indexed_positions_rotate_with_the_embedding_and_vanish_at_index_zero(kind):
    from symattn_cli.nn.knowledge import IndexSinusoidPosition, IndexTablePosition

    torch.manual_seed(0)
    if kind == "sinusoid":
        pos = IndexSinusoidPosition(d_model=D, width=D - 2, base=100.0).double()
    else:
        pos = IndexTablePosition(d_model=D, width=D - 2, rows=9).double()
    index = torch.tensor([[3, 2, 1, 0, 1, 0, 1, 2, 3, 4]])  # (1, n): coupled positions
    p = pos(index)  # (1, n, d)
    assert p.shape == (1, 10, D) and (p[0, [3, 5]] == 0).all()  # operators: no position
    assert torch.equal(p[0, 0], p[0, 8]) and not torch.allclose(p[0, 0], p[0, 1])  # coupled
    q = haar_orthogonal(D, torch.Generator().manual_seed(1))
    assert relative_error(rotate_embedding(pos, q)(index), p @ q.T) <= TOL  # P → QP
    if kind == "table":
        with pytest.raises(ValueError, match="index 9 exceeds the table's 9 rows"):
            pos(index + 5)


def test_perm_factored_sums_match_every_term_summed():
    """The Prop. 4.1 form's factored ψ sums (one hidden activation contracted over k, the
    k = i and k = j terms taken out) equal every ψ term formed, masked and summed: values and
    gradients, float64, with padded tokens."""
    torch.manual_seed(0)
    coef = make_coefficients(form="perm", heads=H, knowledge=K, d_model=D).double()
    for param in coef.parameters():
        param.data.normal_()  # biases too: zeros at start would hide the count terms
    y = torch.randn(2, H, 6, K, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 4:] = False
    real, eye = mask.double(), torch.eye(6, dtype=torch.bool)
    weight = torch.randn(2, H, 6, 6, dtype=torch.float64).masked_fill(eye, 0)  # i = j unused
    inputs = [y, *coef.psi1.parameters(), *coef.psi2.parameters()]

    def run(sums):
        sum1, sum2 = sums
        loss = (sum1 * sum1.detach().cos()).sum() + (sum2 * weight[..., None]).sum()
        return sum1, sum2.masked_fill(eye[..., None], 0), torch.autograd.grad(loss, inputs)

    want1, want2, want_grads = run(coef._sums(y, real, eye))
    got1, got2, got_grads = run(coef._mlp_sums(y, real))
    assert relative_error(got1, want1) <= TOL
    assert relative_error(got2, want2) <= TOL
    for got, want in zip(got_grads, want_grads, strict=True):
        assert relative_error(got, want) <= TOL
    assert relative_error(coef._mlp_sums(y, real.flip(1))[1], got2) > CLEAR_FAILURE
