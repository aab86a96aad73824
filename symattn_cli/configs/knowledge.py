"""Typed configs of the knowledge-attention family (``conf/model/ka_*.yaml``, Ma & Ying 2023)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class KnowledgeAttentionConfig:
    _target_: str = "symattn_cli.models.knowledge.build"
    # g: softmax | sigmoid | kernel | rbf | quartic | general (Prop. 3.2) | perm (Prop. 4.1)
    form: str = "softmax"
    d_model: int = 64
    heads: int = 4
    layers: int = 3
    knowledge: int = 0  # knowledge vectors per head (columns of Z_i); 0 = 2 * d_model / heads
    value_dim: int = 0  # per-head value width; 0 = d_model / heads
    mlp_hidden: int = 256  # position-wise MLP V σ(U ·) width (Eq. 5.2); 0 = no MLP
    activation: str = "gelu"  # MLP nonlinearity
    normalizer: str = ""  # "" = the form's own; softmax | sigmoid | relu | exp | tanh | ...
    mean_keys: bool = False  # element-wise normalizers: divide by the number of real keys
    g_hidden: int = 32  # general / perm: hidden width of the networks of invariants
    g_features: int = 16  # perm: width of ψ's output
    g_activation: str = "gelu"
    score_init: str = "attention"  # quadratic form A at start: attention ([[0,I],[0,0]]) | random
    # footnote (base n) | sinusoidal (base position_base) | learned | none | coupled (each
    # digit's significance, shared by operands and answer, as sinusoids) | abacus (the same
    # index plus a random training offset, in a learned table); all seen through a frame F;
    # relative (the same index, read by the relative index scores only: no vectors)
    position: str = "footnote"
    position_base: float = 10000.0
    position_scale: float = 1.0  # initial scale of the position frame / table
    # coupled / abacus: random training offset k ∈ [0, this] added to every index;
    # -1 = the position's own (abacus: max_len // 2, coupled: 0)
    position_offset: int = -1
    # coupled / abacus: K > 0 adds a learned per-head score of the index difference of query
    # and key, clipped to [-K, K] (farther pairs share one value); 0 = none
    relative_span: int = 0
    relative_window: bool = False  # indexed keys more than relative_span away are not read
    norm: bool = True  # scalar-gain RMS norms (rotation equivariant)
    residual: bool = True
    # the data's facts (symattn_cli.configs.sequences): vocabulary, longest sequence (learned
    # positions must cover it), padding token, token strings, answer order, causal answers
    vocab_size: int = "${data.vocab_size}"
    max_len: int = "${data.seq_len}"
    pad_index: int = "${data.pad_index}"
    tokens: Any = "${data.tokens}"
    answer_order: str = "${data.answer_order}"
    causal_answer: bool = "${data.causal_answer}"


SCHEMAS: list[tuple[str | None, str, Any]] = [
    (None, "ka_schema", KnowledgeAttentionConfig),
]
