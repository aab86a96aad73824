"""Knowledge-attention seq2seq model (``family: ka``), exactly invariant under embedding rotations.

Letters: B batch, n tokens, d embedding, V vocabulary, h heads, k knowledge per head.
Rows layout as in :mod:`symattn_cli.nn.knowledge`: the paper's X ∈ R^{d×n} is ``x[b].T``.

The model: x_t = E[:, token_t] + p_t (E ∈ R^{d×V}, p the position encoding), L stacked
:class:`~symattn_cli.nn.knowledge.KnowledgeBlock` layers (Ma & Ying Sec. 5: multi-head
knowledge attention, position-wise MLP, residual links, scalar RMS norms), then logits
Eᵀ N(h_t) / √d + b (b ∈ R^V). Every parameter with an embedding index (E, Z, W_V, W_out,
U, V, c, the position frame) is knowledge, so for every orthogonal Q

    logits(QE, QZ, QWQᵀ, QP, …) = logits(E, Z, W, P, …)   exactly,

while rotating E alone changes the function (Ma & Ying Sec. 3.2: the target works in a fixed
embedding). :func:`transform_embedding` applies Q; :mod:`symattn_cli.verify.knowledge`
measures both statements.

This module is the config boundary of the family: names (``form``, ``activation``,
``position``) are resolved here into the callables the layers take.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from symattn_cli.data.base import DataSpec
from symattn_cli.errors import ConfigError
from symattn_cli.nn.knowledge import (
    Coefficients,
    ElementwiseNormalizer,
    GeneralCoefficients,
    InnerProductScore,
    KnowledgeAttention,
    KnowledgeBlock,
    LearnedPosition,
    PermutationCoefficients,
    PositionwiseMLP,
    QuadraticScore,
    QuarticScore,
    RBFScore,
    ScalarRMSNorm,
    SinusoidPosition,
    SoftmaxNormalizer,
    rotate_embedding,
)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": nn.functional.gelu,
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "exp": torch.exp,
    "silu": nn.functional.silu,
    "softplus": nn.functional.softplus,
}

# The g forms of Ma & Ying Sec. 3.2–4 and the normaliser each uses unless ``normalizer`` says.
FORMS = {
    "softmax": "softmax",  # softmax of a quadratic form: standard attention (Sec. 3.2)
    "sigmoid": "sigmoid",  # element-wise nonlinearity of a quadratic form (Eq. 3.2)
    "kernel": "softmax",  # inner-product kernel σ(YᵀY) (Sec. 3.3)
    "rbf": "softmax",  # RBF kernel φ(‖y_i − y_j‖) (Sec. 3.3)
    "quartic": "softmax",  # quadratic + the quartic term of Eq. (3.2)
    "general": "softmax",  # X g₁ + Z g₂ of Prop. 3.2 (networks of XᵀX, ZᵀX, ZᵀZ)
    "perm": "softmax",  # ρ/ψ form of Prop. 4.1
}
POSITIONS = ("footnote", "sinusoidal", "learned", "none")
NORMALIZERS = ("softmax", *ACTIVATIONS)


def _choice(kind: str, value: Any, options) -> Any:
    if value not in options:
        raise ConfigError(f"model.{kind}={value!r} is unknown; choose one of {sorted(options)}")
    return value


class KnowledgeSeq2Seq(nn.Module):
    """Token embedding E → knowledge-attention blocks → tied read-out Eᵀ (see module doc).

    ``forward(tokens (B, n)) -> logits (B, n, V)``; tokens equal to ``pad_index`` are masked
    as keys and excluded from the position encoding's length.
    """

    embedding_axes = {"embedding": (0,), "out_bias": ()}

    def __init__(
        self,
        *,
        vocab_size: int,
        pad_index: int,
        d_model: int,
        blocks: list[KnowledgeBlock],
        position: nn.Module | None,
        final_norm: nn.Module,
    ) -> None:
        super().__init__()
        self.pad_index = pad_index
        self.embedding = nn.Parameter(torch.randn(d_model, vocab_size))  # (d, V): E
        self.out_bias = nn.Parameter(torch.zeros(vocab_size))
        self.position = position
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = final_norm
        self.readout_scale = 1.0 / math.sqrt(d_model)

    def embed(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = tokens != self.pad_index  # (B, n)
        x = self.embedding.t()[tokens]  # (B, n, d): columns E[:, token] as rows
        if self.position is not None:
            lengths = mask.sum(-1)  # (B,)
            x = x + self.position(lengths, tokens.shape[1])  # (B, n, d)
        return x, mask

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x, mask = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        h = self.final_norm(x)  # (B, n, d)
        logits = torch.einsum("bnd,dV->bnV", h, self.embedding) * self.readout_scale
        return logits + self.out_bias  # (B, n, V)


def transform_embedding(
    model: nn.Module, q: torch.Tensor, *, embedding_only: bool = False
) -> nn.Module:
    """A copy of ``model`` in the embedding rotated by the orthogonal ``q`` (d, d).

    Default: every embedding-space index of every parameter moves with Q (E → QE, Z → QZ,
    W → QWQᵀ, MLP (V, U) → (QV, UQᵀ), position frame F → QF): the copy computes exactly the
    same logits. ``embedding_only=True`` rotates the token embedding E alone (the negative
    control of Ma & Ying Sec. 3.2): the copy no longer computes the same function.
    """
    if embedding_only:
        return rotate_embedding(model, q, include=lambda name: name == "embedding")
    return rotate_embedding(model, q)


# --------------------------------------------------------------------------------------------
# Config boundary
# --------------------------------------------------------------------------------------------


def make_coefficients(
    *,
    form: str,
    heads: int,
    knowledge: int,
    d_model: int,
    normalizer: str = "",
    mean_keys: bool = False,
    hidden: int = 32,
    features: int = 16,
    activation: str = "gelu",
    score_init: str = "attention",
) -> nn.Module:
    """The g of one ``form`` name (``FORMS``) as the module :class:`KnowledgeAttention` takes."""
    _choice("form", form, FORMS)
    act = ACTIVATIONS[_choice("activation", activation, ACTIVATIONS)]
    norm_name = normalizer or FORMS[form]
    _choice("normalizer", norm_name, NORMALIZERS)
    if form == "general":
        return GeneralCoefficients(
            heads=heads, knowledge=knowledge, hidden=hidden, activation=act, d_model=d_model
        )
    if form == "perm":
        return PermutationCoefficients.learned(
            heads=heads,
            knowledge=knowledge,
            features=features,
            hidden=hidden,
            activation=act,
            normalize="softmax" if norm_name == "softmax" else "none",
        )
    scale = 1.0 / math.sqrt(knowledge // 2 if knowledge > 1 else 1)  # 1/√d₁ of Eq. (2.1)
    if score_init not in ("attention", "random"):
        raise ConfigError(f"model.score_init={score_init!r} is unknown; use attention or random")
    if form in ("softmax", "sigmoid"):
        score = QuadraticScore(heads=heads, knowledge=knowledge, scale=scale, init=score_init)
    elif form == "quartic":
        score = QuarticScore(heads=heads, knowledge=knowledge, scale=scale, init=score_init)
    elif form == "kernel":
        score = InnerProductScore(scale=scale)
    else:  # rbf
        score = RBFScore(heads=heads, scale=scale / 2)
    if norm_name == "softmax":
        norm: nn.Module = SoftmaxNormalizer()
    else:
        norm = ElementwiseNormalizer(ACTIVATIONS[norm_name], mean=mean_keys)
    return Coefficients(score, norm)


def build_model(
    *,
    vocab_size: int,
    pad_index: int,
    max_len: int,
    form: str = "softmax",
    d_model: int = 64,
    heads: int = 4,
    layers: int = 3,
    knowledge: int = 0,
    value_dim: int = 0,
    mlp_hidden: int = 256,
    activation: str = "gelu",
    normalizer: str = "",
    mean_keys: bool = False,
    g_hidden: int = 32,
    g_features: int = 16,
    g_activation: str = "gelu",
    score_init: str = "attention",
    position: str = "footnote",
    position_base: float = 10000.0,
    position_scale: float = 1.0,
    norm: bool = True,
    residual: bool = True,
) -> KnowledgeSeq2Seq:
    """Build a :class:`KnowledgeSeq2Seq` from keyword arguments (names resolved here).

    ``knowledge=0`` means 2·d/h (Z_i = [W_Qᵀ, W_Kᵀ] of a standard head); ``value_dim=0``
    means d/h; ``mlp_hidden=0`` drops the position-wise MLPs.
    """
    if d_model < 1 or heads < 1 or layers < 0:
        raise ConfigError(
            f"model sizes must be positive: d_model={d_model}, heads={heads}, layers={layers}"
        )
    _choice("position", position, POSITIONS)
    knowledge = knowledge or max(2, 2 * (d_model // heads))
    value_dim = value_dim or max(1, d_model // heads)
    mlp_act = ACTIVATIONS[_choice("activation", activation, ACTIVATIONS)]
    blocks = []
    for _ in range(layers):
        coefficients = make_coefficients(
            form=form,
            heads=heads,
            knowledge=knowledge,
            d_model=d_model,
            normalizer=normalizer,
            mean_keys=mean_keys,
            hidden=g_hidden,
            features=g_features,
            activation=g_activation,
            score_init=score_init,
        )
        attention = KnowledgeAttention(
            d_model=d_model,
            heads=heads,
            knowledge=knowledge,
            value_dim=value_dim,
            coefficients=coefficients,
        )
        mlp = (
            PositionwiseMLP(d_model=d_model, hidden=mlp_hidden, activation=mlp_act)
            if mlp_hidden
            else None
        )
        blocks.append(
            KnowledgeBlock(
                attention=attention,
                mlp=mlp,
                norm=ScalarRMSNorm if norm else None,
                residual=residual,
            )
        )
    width = d_model - d_model % 2
    if position == "footnote":
        pos: nn.Module | None = SinusoidPosition(
            d_model=d_model, width=width, base=None, init_scale=position_scale
        )
    elif position == "sinusoidal":
        pos = SinusoidPosition(
            d_model=d_model, width=width, base=position_base, init_scale=position_scale
        )
    elif position == "learned":
        if max_len < 1:
            raise ConfigError("position=learned needs the data's max_len (got 0)")
        pos = LearnedPosition(d_model=d_model, max_len=max_len, init_scale=position_scale)
    else:
        pos = None
    return KnowledgeSeq2Seq(
        vocab_size=vocab_size,
        pad_index=pad_index,
        d_model=d_model,
        blocks=blocks,
        position=pos,
        final_norm=ScalarRMSNorm() if norm else nn.Identity(),
    )


_BUILD_KEYS = (
    "form",
    "d_model",
    "heads",
    "layers",
    "knowledge",
    "value_dim",
    "mlp_hidden",
    "activation",
    "normalizer",
    "mean_keys",
    "g_hidden",
    "g_features",
    "g_activation",
    "score_init",
    "position",
    "position_base",
    "position_scale",
    "norm",
    "residual",
)


def build(options: dict[str, Any], spec: DataSpec) -> KnowledgeSeq2Seq:
    """``family: ka`` builder: model options + the data's sizes -> :class:`KnowledgeSeq2Seq`."""
    if spec.task != "tokens":
        raise ConfigError(
            f"knowledge-attention models need a token (sequence) dataset; the data's task is "
            f"{spec.task!r}: use data=arithmetic, data=sort or data=reverse"
        )
    unknown = sorted(set(options) - set(_BUILD_KEYS) - {"vocab_size", "max_len"})
    if unknown:
        raise ConfigError(f"unknown knowledge-attention model options {unknown}")
    kwargs = {key: options[key] for key in _BUILD_KEYS if key in options}
    return build_model(
        vocab_size=options.get("vocab_size") or spec.vocab_size or spec.num_classes,
        pad_index=spec.pad_index,
        max_len=options.get("max_len") or spec.max_len,
        **kwargs,
    )


def default_spec(options: dict[str, Any]) -> DataSpec:
    """Sizes of the default ``arithmetic`` task (two-digit operands): 15 tokens, n = 10.

    The same numbers as :mod:`symattn_cli.data.sequences` (pad, '_', '=', '+', '-', 0–9),
    repeated here because models do not import the data layer.
    """
    tokens = ("<pad>", "_", "=", "+", "-", *"0123456789")
    return DataSpec(
        task="tokens",
        num_classes=len(tokens),
        vocab_size=len(tokens),
        max_len=10,
        pad_index=0,
        arch="sequence",
        tokens=tokens,
    )
