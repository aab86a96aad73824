"""The knowledge-attention seq2seq model: exact invariance, permutation laws, configs."""

from __future__ import annotations

import pytest
import torch

from symattn_cli.data.base import DataSpec
from symattn_cli.errors import ConfigError
from symattn_cli.models.knowledge import FORMS, build, build_model, default_spec
from symattn_cli.verify.knowledge import (
    CLEAR_FAILURE,
    TOLERANCES,
    model_orthogonal_errors,
    model_permutation_error,
)

TOL = TOLERANCES[torch.float64]
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
    with pytest.raises(ConfigError, match="token"):
        build({}, DataSpec(task="classify", num_classes=10))


@pytest.mark.parametrize(
    "name",
    ["ka_softmax", "ka_sigmoid", "ka_kernel", "ka_rbf", "ka_quartic", "ka_general", "ka_perm"],
)
def test_yaml_models_build(name):
    from symattn_cli.models.registry import create_model

    model = create_model(name)
    out = model(tokens(n=10))
    assert out.shape == (3, 10, 15) and torch.isfinite(out).all()
