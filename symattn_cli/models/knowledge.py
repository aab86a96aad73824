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

Positions as knowledge (``position=coupled|abacus``): each token gets an index c_t from the
token structure (:func:`coupled_index`): a digit's significance within its number (1 = units),
shared by the operands and the answer (position coupling, Cho et al. 2024); 0 for operators.
``coupled`` encodes c_t by sinusoids through the frame F (defined at every index);
``abacus`` looks it up in a learned table through F (Abacus embeddings, McLeish et al.
2024). In training, c_t + k is used with k drawn per sequence from [0, position_offset]
(abacus by default, coupled when asked; 0 in evaluation), so that indices beyond the
training lengths are seen too. Either way p_t = F(…)
rotates with the embedding (F → QF) and the invariance above holds exactly.

Relative index scores (``relative_span`` K > 0, indexed positions only): every attention
score gets a learned term b_h[u_ji] of the index difference of query j and key i,
u_ji = clip(c_i − c_j, −K, K), and one more bucket where either index is 0 (an operator).
The buckets also tell whether the query and the key are in the answer. Differences beyond
K share one learned value, so pairs farther apart than any training sequence holds read as
"far", as the pairs at K + 1 … 10 did in training. ``relative_window`` masks those pairs
instead: an indexed token reads the indexed tokens within K of its index and the tokens
without one, a window whose size does not grow with the length. The term and the mask are
functions of the indices alone: invariant, the law above is unchanged. In evaluation the
window is computed over listed pairs (:func:`window_rows`): each indexed query's keys are
found by sorting the indices, so no (n, n) tensor is built and a pass costs O(n) in the
length; the few tokens without an index read every key as before.

Causal answers (``DataSpec.causal_answer``): answer position t holds the answer token before
it (teacher forcing in training); a prompt token reads the prompt only, an answer token the
prompt and the answer up to itself. Evaluation decodes greedily: the answer inputs are the
model's own predictions, iterated to the fixed point (exactly greedy decoding; see
:meth:`KnowledgeSeq2Seq.forward`).

This module is the config boundary of the family: names (``form``, ``activation``,
``position``) are resolved here into the callables the layers take.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from symattn_cli.errors import ConfigError
from symattn_cli.nn.knowledge import (
    Coefficients,
    ElementwiseNormalizer,
    GeneralCoefficients,
    IndexSinusoidPosition,
    IndexTablePosition,
    InnerProductScore,
    KeyRows,
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
POSITIONS = ("footnote", "sinusoidal", "learned", "coupled", "abacus", "relative", "none")
INDEXED_POSITIONS = ("coupled", "abacus", "relative")  # index c_t from the token structure
CAUSAL_FORMS = ("softmax", "sigmoid", "kernel", "rbf")  # g reads each query's keys only
NORMALIZERS = ("softmax", *ACTIVATIONS)
DIGITS = tuple("0123456789")


def _choice(kind: str, value: Any, options) -> Any:
    if value not in options:
        raise ConfigError(f"model.{kind}={value!r} is unknown; choose one of {sorted(options)}")
    return value


def coupled_index(
    tokens: torch.Tensor, *, digits: torch.Tensor, slot: int, pad: int, answer_order: str
) -> torch.Tensor:
    """c (B, n) int64: each token's coupled position, from the token structure alone.

    The answer runs from the first ``slot`` token to the last real token; there c_t counts
    from its first token (``answer_order="lsd"``: least significant digit first) or from its
    last (``"msd"``), starting at 1. Before it, a digit (``digits`` (V,) bool marks digit ids)
    gets its significance in its run of digits, 1 for the run's last digit (units of a number
    written most significant first); every other token 0. For sort and reverse
    (``s₁ … s_m = _ … _``) this couples answer slot t with input symbol m + 1 − t.
    """
    bsz, n = tokens.shape
    pos = torch.arange(n, device=tokens.device).expand(bsz, n)  # (B, n)
    real = tokens != pad  # (B, n)
    is_digit = digits.to(tokens.device)[tokens]  # (B, n)
    first_slot = torch.where(tokens == slot, pos, n).amin(-1, keepdim=True)  # (B, 1)
    answer = (pos >= first_slot) & real  # (B, n)
    if answer_order == "lsd":
        answer_index = pos - first_slot + 1  # (B, n)
    else:
        answer_index = real.sum(-1, keepdim=True) - pos  # (B, n): padding only at the end
    stops = torch.where(is_digit & ~answer, n, pos)  # (B, n): where digit runs end
    next_stop = stops.flip(-1).cummin(-1).values.flip(-1)  # (B, n): first stop at or after t
    digit_index = torch.where(is_digit & ~answer, next_stop - pos, 0)  # (B, n)
    return torch.where(answer, answer_index, digit_index)


def relative_buckets(index: torch.Tensor, answer: torch.Tensor, span: int) -> torch.Tensor:
    """u (B, n, n) int64: bucket of (query j, key i) for the relative index scores.

    With w = 2·span + 1: u_ji = clip(c_i − c_j, −span, span) + span + w·(2·[j in the answer]
    + [i in the answer]) ∈ [0, 4w), and 4w where c_i or c_j is 0 (a token without an index).
    ``index`` (B, n) int64: the coupled index c; ``answer`` (B, n) bool.
    """
    return pair_buckets(index[:, :, None], index[:, None, :], answer[:, :, None],
                        answer[:, None, :], span)  # fmt: skip


def pair_buckets(c_q, c_k, answer_q, answer_k, span: int) -> torch.Tensor:
    """The buckets of :func:`relative_buckets` for broadcastable query and key indices
    ``c_q``, ``c_k`` (int64) and answer flags ``answer_q``, ``answer_k`` (bool)."""
    width = 2 * span + 1
    diff = (c_k - c_q).clamp(-span, span) + span
    part = 2 * answer_q.long() + answer_k.long()
    unindexed = (c_k == 0) | (c_q == 0)
    return torch.where(unindexed, 4 * width, diff + width * part)


def pair_attend(pos_q, pos_k, answer_q, answer_k, real_k, causal: bool) -> torch.Tensor:
    """Whether query pos_q reads key pos_k (broadcastable): a real key; with ``causal``, a
    prompt key, or an answer key no later than an answer query."""
    if not causal:
        return real_k
    return (real_k & ~answer_k) | (answer_q & answer_k & (pos_k <= pos_q))


def window_rows(
    index: torch.Tensor, answer: torch.Tensor, real: torch.Tensor, *, span: int, causal: bool
) -> list[KeyRows]:
    """The pairs of the relative window (``relative_window``) as :class:`KeyRows`, in O(n·m).

    Two lists: every indexed query with the tokens without an index and the indexed keys whose
    index is within ``span`` of its own (found by sorting the indices and bisecting, m ≤
    unindexed + all tokens of 2·span + 1 indices), and the few tokens without an index, each
    with every key. The pairs, causal rule and buckets are those of the dense layout.
    ``index`` (B, n) int64, ``answer`` and ``real`` (B, n) bool.
    """
    bsz, n = index.shape
    pos = torch.arange(n, device=index.device).expand(bsz, n)  # (B, n)
    last = int(index.max()) + span + 1  # sorts padding after every window
    order_key = torch.where(real, index, last)  # (B, n): unindexed, then by index, padding
    sorted_key, order = order_key.sort(dim=-1, stable=True)  # (B, n)
    unindexed = (real & (index == 0)).sum(-1)  # (B,)
    u = int(unindexed.max())
    lo = torch.searchsorted(sorted_key, (index - span).clamp_min(1))  # (B, n)
    hi = torch.searchsorted(sorted_key, index + span, right=True)  # (B, n)
    indexed_q = real & (index > 0)  # (B, n)
    m = int(torch.where(indexed_q, hi - lo, 0).max())
    slots = lo[..., None] + torch.arange(m, device=index.device)  # (B, n, m)
    band = order.gather(1, slots.clamp_max(n - 1).flatten(1)).view(bsz, n, m)  # (B, n, m)
    in_band = slots < hi[..., None]  # (B, n, m)
    first = order[:, :u]  # (B, u): the tokens without an index
    first_valid = torch.arange(u, device=index.device) < unindexed[:, None]  # (B, u)
    keys = torch.cat([first[:, None].expand(bsz, n, u), band], -1)  # (B, n, u + m)
    valid = torch.cat([first_valid[:, None].expand(bsz, n, u), in_band], -1)  # (B, n, u + m)
    rows = [(pos, keys, valid & indexed_q[..., None]), (first, pos[:, None].expand(bsz, u, n),
            first_valid[..., None].expand(bsz, u, n))]  # fmt: skip
    out = []
    for query, key, ok in rows:
        c_q, c_k = index.gather(1, query)[..., None], index.gather(1, key.flatten(1)).view_as(key)
        a_q = answer.gather(1, query)[..., None]  # (B, r, 1)
        a_k = answer.gather(1, key.flatten(1)).view_as(key)  # (B, r, m)
        r_k = real.gather(1, key.flatten(1)).view_as(key)
        ok = ok & pair_attend(query[..., None], key, a_q, a_k, r_k, causal)
        out.append(KeyRows(query, key, ok, pair_buckets(c_q, c_k, a_q, a_k, span)))
    return out


def relative_bucket_count(span: int) -> int:
    """The number of buckets of :func:`relative_buckets` (0 for no relative term)."""
    return 4 * (2 * span + 1) + 1 if span else 0


@dataclass
class Layout:
    """What the tokens fix for one forward pass (B batch, n tokens)."""

    real: torch.Tensor  # (B, n) True at real tokens
    attend: torch.Tensor  # (B, n), or (B, n, n) True where query j reads key i (causal)
    lengths: torch.Tensor  # (B,) real tokens per sequence
    index: torch.Tensor | None  # (B, n) coupled index of an indexed position, else None
    answer: torch.Tensor | None  # (B, n) True in the answer (indexed or causal), else None
    buckets: torch.Tensor | None = None  # (B, n, n) relative index buckets, else None
    rows: list[KeyRows] | None = None  # listed window pairs in place of attend and buckets


class KnowledgeSeq2Seq(nn.Module):
    """Token embedding E → knowledge-attention blocks → tied read-out Eᵀ (see module doc).

    ``forward(tokens (B, n)) -> logits (B, n, V)``; tokens equal to ``pad_index`` are masked
    as keys and excluded from the position encoding's length. ``position_shift`` adds a
    constant to an indexed position (the non-degeneracy check: the output must change).
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
        indexer: Callable[[torch.Tensor], torch.Tensor] | None = None,
        position_offset: int = 0,
        causal: bool = False,
        slot_index: int = 1,
        relative_span: int = 0,
        relative_window: bool = False,
    ) -> None:
        super().__init__()
        self.pad_index = pad_index
        self.embedding = nn.Parameter(torch.randn(d_model, vocab_size))  # (d, V): E
        self.out_bias = nn.Parameter(torch.zeros(vocab_size))
        self.position = position
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = final_norm
        self.readout_scale = 1.0 / math.sqrt(d_model)
        self.indexer = indexer  # tokens -> coupled index (B, n), for indexed positions
        self.position_offset = position_offset  # random training offset k ∈ [0, offset]
        self.causal = causal
        self.slot_index = slot_index
        self.relative_span = relative_span  # K of the relative index scores; 0: none
        self.relative_window = relative_window  # indexed keys beyond K are not read

    def layout(
        self, tokens: torch.Tensor, position_shift: int = 0, windowed: bool = False
    ) -> Layout:
        """What ``tokens`` fix; ``windowed`` (``relative_window`` only): the window's pairs as
        :func:`window_rows` lists instead of (B, n, n) masks and buckets."""
        real = tokens != self.pad_index  # (B, n)
        index = answer = None
        if self.indexer is not None or self.causal:
            n = tokens.shape[1]
            pos = torch.arange(n, device=tokens.device).expand_as(tokens)  # (B, n)
            first = torch.where(tokens == self.slot_index, pos, n).amin(-1, keepdim=True)
            answer = (pos >= first) & real  # (B, n)
        if self.indexer is not None:
            index = self.indexer(tokens)  # (B, n)
            if self.training and self.position_offset > 0:
                offset = torch.randint(
                    0, self.position_offset + 1, (tokens.shape[0], 1), device=tokens.device
                )  # (B, 1): one k per sequence keeps the coupling
                index = index + offset * (index > 0)
            if position_shift:
                index = index + position_shift * (index > 0)
        if windowed:
            rows = window_rows(index, answer, real, span=self.relative_span, causal=self.causal)
            return Layout(real, real, real.sum(-1), index, answer, rows=rows)
        attend = real  # (B, n), or (B, n, n) per query
        if self.causal:
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            earlier = pos[None, :, None] >= pos[None, None, :]  # (1, n_j, n_i): i ≤ j
            prompt = real & ~answer  # (B, n)
            attend = prompt[:, None, :] | (answer[:, :, None] & answer[:, None, :] & earlier)
        buckets = None
        if self.relative_span:
            buckets = relative_buckets(index, answer, self.relative_span)
        if self.relative_window:
            indexed = (index[:, None, :] > 0) & (index[:, :, None] > 0)  # (B, n_j, n_i)
            far = indexed & ((index[:, None, :] - index[:, :, None]).abs() > self.relative_span)
            attend = (attend if attend.dim() == 3 else attend[:, None, :]) & ~far
        return Layout(real, attend, real.sum(-1), index, answer, buckets)

    def embed(self, tokens: torch.Tensor, layout: Layout) -> torch.Tensor:
        """x (B, n, d): token embeddings plus the position encoding."""
        x = self.embedding.t()[tokens]  # (B, n, d): columns E[:, token] as rows
        if layout.index is not None:
            if self.position is not None:  # position=relative: the index reaches the scores only
                x = x + self.position(layout.index)  # (B, n, d)
        elif self.position is not None:
            x = x + self.position(layout.lengths, tokens.shape[1])  # (B, n, d)
        return x

    def readout(self, x: torch.Tensor) -> torch.Tensor:
        """(B, n, d) → logits (B, n, V): Eᵀ N(h) / √d + b."""
        h = self.final_norm(x)  # (B, n, d)
        logits = torch.einsum("bnd,dV->bnV", h, self.embedding) * self.readout_scale
        return logits + self.out_bias  # (B, n, V)

    def logits(self, tokens: torch.Tensor, layout: Layout) -> torch.Tensor:
        """One pass: (B, n) tokens under ``layout`` → logits (B, n, V)."""
        x = self.embed(tokens, layout)  # (B, n, d)
        for block in self.blocks:
            x = block(x, layout.attend, buckets=layout.buckets, rows=layout.rows)
        return self.readout(x)

    def _decode_windowed(self, inputs: torch.Tensor, layout: Layout) -> torch.Tensor:
        """Greedy decoding over the window's listed pairs, one answer position per step.

        One full pass with blank answers keeps every block's input; a prompt row reads the
        prompt only, so it is final. Step s then recomputes, at every block, only answer
        position a + s of each sequence (fed the prediction at a + s − 1) from its listed keys,
        all at positions ≤ a + s and already final: exactly greedy decoding, each step
        costing a window instead of a sequence.
        """
        band = layout.rows[0]  # every indexed query; answer tokens are indexed
        x = self.embed(inputs, layout)  # (B, n, d)
        states = [x]
        for block in self.blocks:
            x = block(x, layout.attend, rows=layout.rows)
            states.append(x)
        logits = self.readout(x)  # (B, n, V)
        bsz, n = inputs.shape
        pos = torch.arange(n, device=inputs.device).expand(bsz, n)  # (B, n)
        first = torch.where(layout.answer, pos, n).amin(-1)  # (B,): the first answer position
        count = layout.answer.sum(-1)  # (B,)
        rows = torch.arange(bsz, device=inputs.device)  # (B,)
        for step in range(1, int(count.max())):
            live = step < count  # (B,)
            t = torch.where(live, first + step, 0)  # (B,)
            fed = torch.where(live, logits[rows, t - 1].argmax(-1), inputs[rows, t])  # (B,)
            inputs[rows, t] = fed
            at = t[:, None]  # (B, 1)
            buckets = None if band.buckets is None else band.buckets[rows, t][:, None]
            part = KeyRows(at, band.keys[rows, t][:, None], band.valid[rows, t][:, None], buckets)
            row_layout = Layout(layout.real, layout.real, layout.lengths,
                                None if layout.index is None else layout.index[rows, t][:, None],
                                None)  # fmt: skip
            row = self.embed(fed[:, None], row_layout)  # (B, 1, d)
            keep = live[:, None]  # (B, 1)
            for level, block in enumerate(self.blocks):
                states[level][rows, t] = torch.where(keep, row[:, 0], states[level][rows, t])
                row = block.at_rows(states[level], part)  # (B, 1, d)
            states[-1][rows, t] = torch.where(keep, row[:, 0], states[-1][rows, t])
            logits[rows, t] = torch.where(keep, self.readout(row)[:, 0], logits[rows, t])
        return logits

    def forward(
        self, tokens: torch.Tensor, *, position_shift: int = 0, windowed: bool | None = None
    ) -> torch.Tensor:
        """Logits (B, n, V). Causal answers in evaluation: greedy decoding.

        ``windowed`` (default: in evaluation with ``relative_window``) computes the window over
        listed pairs (:func:`window_rows`); the logits of real tokens are those of the dense
        masks. Padding positions read nothing there (their logits differ and are never read).

        Greedy decoding reads each answer input from the prediction one position earlier,
        never from ``tokens``. Iterating "inputs ← predictions shifted by one" from blank
        inputs reaches the greedy answer: the first answer position's input is fixed, so its
        prediction is final after one pass, the next after two, …, and any fixed point is the
        greedy answer. The loop stops at the fixed point (at most answer-length + 1 passes)
        and returns its logits, those of the greedy prefixes.
        """
        if windowed is None:
            windowed = self.relative_window and not self.training
        if windowed and not self.relative_window:
            raise ValueError("windowed=True needs a model built with relative_window")
        layout = self.layout(tokens, position_shift, windowed)
        if not self.causal or self.training:
            return self.logits(tokens, layout)
        follows = torch.zeros_like(layout.answer)  # (B, n): answer inputs read from t − 1
        follows[:, 1:] = layout.answer[:, 1:] & layout.answer[:, :-1]
        inputs = torch.where(follows, self.slot_index, tokens)  # (B, n): blank answers
        if windowed:
            return self._decode_windowed(inputs, layout)
        for _ in range(int(layout.answer.sum(-1).max()) + 1):
            logits = self.logits(inputs, layout)
            shifted = torch.roll(logits.argmax(-1), 1, dims=1)  # (B, n): prediction at t − 1
            fed = torch.where(follows, shifted, inputs)
            if torch.equal(fed, inputs):
                break
            inputs = fed
        return logits


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
    position_offset: int = -1,
    relative_span: int = 0,
    relative_window: bool = False,
    norm: bool = True,
    residual: bool = True,
    tokens: tuple[str, ...] = (),
    answer_order: str = "lsd",
    causal: bool = False,
) -> KnowledgeSeq2Seq:
    """Build a :class:`KnowledgeSeq2Seq` from keyword arguments (names resolved here).

    ``knowledge=0`` means 2·d/h (Z_i = [W_Qᵀ, W_Kᵀ] of a standard head); ``value_dim=0``
    means d/h; ``mlp_hidden=0`` drops the position-wise MLPs. ``position=coupled|abacus``
    need the token strings (``tokens``: digits "0"–"9" and the slot "_") and the answer's
    digit order; ``position_offset`` is the largest random training offset of an indexed
    position (-1: abacus max_len // 2, coupled none); the abacus table has
    max_len + offset + 1 rows. ``relative_span`` K > 0 adds the relative index scores
    (indexed positions and score-and-normaliser forms only); ``relative_window`` also stops
    every indexed query from reading indexed keys more than K away. ``causal``: causal
    answers.
    """
    if d_model < 1 or heads < 1 or layers < 0:
        raise ConfigError(
            f"model sizes must be positive: d_model={d_model}, heads={heads}, layers={layers}"
        )
    for name, value, zero in (
        ("knowledge", knowledge, "2·d_model/heads"),
        ("value_dim", value_dim, "d_model/heads"),
        ("mlp_hidden", mlp_hidden, "no MLP"),
    ):
        if value < 0:
            raise ConfigError(f"model.{name}={value} must be >= 0 (0: {zero})")
    networks = {"general": ("g_hidden",), "perm": ("g_hidden", "g_features")}.get(form, ())
    for name, value in (("g_hidden", g_hidden), ("g_features", g_features)):
        if name in networks and value < 1:
            raise ConfigError(
                f"model.{name}={value}: the {form} form's networks of invariants need "
                "a width of at least 1 (the presets use 16 or 32)"
            )
    _choice("position", position, POSITIONS)
    if relative_span < 0:
        raise ConfigError(f"model.relative_span={relative_span} must be >= 0 (0: no relative term)")
    if position == "relative" and not relative_span:
        raise ConfigError(
            "model.position=relative reads positions through the relative index scores only: "
            "set model.relative_span to a positive span (e.g. 3)"
        )
    if relative_span and position not in INDEXED_POSITIONS:
        raise ConfigError(
            f"model.relative_span={relative_span} scores differences of position indices, but "
            f"model.position={position} has none: use position=coupled or abacus, or "
            "relative_span=0"
        )
    if relative_window and (not relative_span or form not in CAUSAL_FORMS):
        raise ConfigError(
            f"model.relative_window=true reads each digit's window of model.relative_span "
            f"indices (now {relative_span}) through a per-query mask: it needs relative_span "
            f"> 0 and a form that reads per-query masks, one of {CAUSAL_FORMS} "
            f"(model.form={form})"
        )
    if relative_span and form in ("general", "perm"):
        raise ConfigError(
            f"model.relative_span={relative_span}: model.form={form} has no single score to add "
            "the relative term to; use softmax, sigmoid, kernel, rbf or quartic, or "
            "relative_span=0"
        )
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
            relative=relative_bucket_count(relative_span),
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
    if causal and form not in CAUSAL_FORMS:
        raise ConfigError(
            f"model.form={form!r} sums over all tokens, so it cannot read causal answers "
            f"(data.decoding=causal); use one of {CAUSAL_FORMS} or data.decoding=one_pass"
        )
    indexer, slot_index = None, tokens.index("_") if "_" in tokens else 1
    if position in INDEXED_POSITIONS:
        if "_" not in tokens or not any(t in DIGITS for t in tokens):
            raise ConfigError(
                f"model.position={position} indexes digits and answer slots, but the data's "
                f"tokens {tokens} have no digits or no '_': use a sequence task (addition, "
                "arithmetic, sort, reverse) or another position"
            )
        if answer_order not in ("lsd", "msd"):
            raise ConfigError(f"answer_order={answer_order!r} is unknown; use lsd or msd")
        indexer = partial(
            coupled_index,
            digits=torch.tensor([t in DIGITS for t in tokens]),
            slot=slot_index,
            pad=pad_index,
            answer_order=answer_order,
        )
    if position_offset < -1:
        raise ConfigError(
            f"model.position_offset={position_offset} must be >= 0 (or -1: the position's own)"
        )
    if position not in ("coupled", "abacus"):  # relative: differences ignore an offset
        position_offset = 0
    elif position_offset == -1:  # abacus: max_len // 2; coupled: none
        position_offset = max(1, max_len // 2) if position == "abacus" else 0
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
    elif position == "coupled":
        pos = IndexSinusoidPosition(
            d_model=d_model, width=width, base=position_base, init_scale=position_scale
        )
    elif position == "abacus":
        if max_len < 1:
            raise ConfigError("position=abacus needs the data's max_len (got 0)")
        pos = IndexTablePosition(
            d_model=d_model,
            width=width,
            rows=max_len + position_offset + 1,
            init_scale=position_scale,
        )
    else:
        pos = None
    return KnowledgeSeq2Seq(
        vocab_size=vocab_size,
        pad_index=pad_index,
        d_model=d_model,
        blocks=blocks,
        position=pos,
        final_norm=ScalarRMSNorm() if norm else nn.Identity(),
        indexer=indexer,
        position_offset=position_offset,
        causal=causal,
        slot_index=slot_index,
        relative_span=relative_span,
        relative_window=relative_window,
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
    "position_offset",
    "relative_span",
    "relative_window",
    "norm",
    "residual",
)


def build(
    *,
    vocab_size: int,
    max_len: int = 0,
    pad_index: int = 0,
    tokens: Sequence[str] = (),
    answer_order: str = "lsd",
    causal_answer: bool = False,
    **options: Any,
) -> KnowledgeSeq2Seq:
    """``_target_`` of the knowledge-attention configs: model options and the data's facts
    (vocabulary, longest sequence, padding token, token strings, answer order, causal answers)
    -> :class:`KnowledgeSeq2Seq`. The options are the fields of
    :class:`symattn_cli.configs.knowledge.KnowledgeAttentionConfig`."""
    unknown = sorted(set(options) - set(_BUILD_KEYS))
    if unknown:
        raise ConfigError(f"unknown knowledge-attention model options {unknown}")
    return build_model(vocab_size=vocab_size, pad_index=pad_index, max_len=max_len,
                       tokens=tuple(tokens or ()), answer_order=answer_order,
                       causal=causal_answer, **options)  # fmt: skip
