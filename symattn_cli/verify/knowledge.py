"""Numerical checks of knowledge attention (Ma & Ying 2023): every function returns numbers.

Layout as in :mod:`symattn_cli.nn.knowledge` (rows: ``x`` (B, n, d) is the paper's Xᵀ).
Letters: B batch, n tokens, d embedding, V vocabulary, k knowledge, h heads.

Errors are relative, ‖f₁ − f₂‖_max / ‖f₂‖_max, computed in the dtype given (float64 for the
exactness claims, where they sit at 1e-15 … 1e-13). What is checked:

* orthogonal equivariance with knowledge (Def. 3.2) of layers and of whole models, for
  seeded Haar-random Q ∈ O(d), every embedding-space parameter transformed — and the negative
  control: rotating X (or the token embedding E) alone must fail clearly;
* permutation equivariance (Def. 4.1, seed note) in both conventions, f(XP) = f(X)P on
  columns and f(PX) = P f(X) on rows — and its negative control: adding a position encoding
  breaks it;
* identities: standard multi-head self-attention (``torch.nn.MultiheadAttention``) equals the
  knowledge form with Z = [W_Qᵀ, W_Kᵀ], A = [[0, I], [0, 0]] (Sec. 3.2); Remark 4.1's ρ/ψ
  reproduce softmax attention (after the correction described at :func:`remark41_errors`);
* the paper's Sec. 3.2 counter-example: the arithmetic target in a fixed embedding is not
  orthogonal equivariant (swapping e₊ and e₋ turns "2 + 1" into "2 − 1");
* embedding transfer on a trained model (:func:`embedding_transfer`);
* positions as knowledge (``position=coupled|abacus``, on addition): the same orthogonal
  invariance, the non-degeneracy check that the logits change when every position index
  moves (:func:`position_shift_change`), and for causal answers that no logit reads a later
  answer token (:func:`causal_leak`); with relative index scores, that they read index
  differences only and that the logits read them (:func:`relative_index_changes`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from symattn_cli.data.base import IGNORE_INDEX
from symattn_cli.nn.knowledge import (
    Coefficients,
    Invariants,
    KnowledgeAttention,
    PermutationCoefficients,
    QuadraticScore,
    SoftmaxNormalizer,
    rotate_embedding,
)

# Relative-error tolerances by dtype for the exact (no interpolation) claims.
TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-4}
# A negative control must exceed this to count as "fails clearly".
CLEAR_FAILURE = 1e-2


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """‖value − reference‖_max / ‖reference‖_max as a Python float (float64)."""
    diff = (value.detach().double() - reference.detach().double()).abs().max()
    scale = reference.detach().double().abs().max().clamp_min(1e-300)
    return float(diff / scale)


def haar_orthogonal(d: int, generator: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """A Haar-distributed Q ∈ O(d): QR of a Gaussian matrix with the signs of diag(R) fixed."""
    gauss = torch.randn(d, d, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)
    q = q * torch.sign(torch.diagonal(r))[None, :]  # (d, d): uniform over O(d)
    return q.to(dtype)


def random_permutation(n: int, generator: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """A uniformly random permutation matrix P (n, n), never the identity when n > 1."""
    while True:
        perm = torch.randperm(n, generator=generator)
        if n < 2 or not torch.equal(perm, torch.arange(n)):
            return torch.eye(n, dtype=dtype)[perm]  # (n, n)


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------


def layer_orthogonal_errors(
    layer: nn.Module,
    x: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    knowledge: torch.Tensor | None = None,
    samples: int = 4,
    seed: int = 0,
) -> dict[str, float]:
    """Max over Haar samples of the equivariance errors of a layer x (B, n, d) -> (B, n, d).

    ``with_knowledge``: ‖f_{QZ,QWQᵀ}(XQᵀ, ZextQᵀ) − f(X)Qᵀ‖ (Def. 3.2; must be ~0).
    ``input_only``: ‖f_{Z,W}(XQᵀ) − f(X)Qᵀ‖, the knowledge left in place (must be large).
    """
    gen = torch.Generator().manual_seed(seed)
    d = x.shape[-1]
    call = (lambda f, xx, kk: f(xx, mask, kk)) if knowledge is not None else None
    if call is None:

        def call(f, xx, kk):
            return f(xx, mask) if mask is not None else f(xx)

    ref = call(layer, x, knowledge)
    worst = {"with_knowledge": 0.0, "input_only": 0.0}
    for _ in range(samples):
        q = haar_orthogonal(d, gen, x.dtype)
        rotated = rotate_embedding(layer, q)
        kq = knowledge @ q.T if knowledge is not None else None
        want = ref @ q.T  # (B, n, d): Q f(X) in rows
        worst["with_knowledge"] = max(
            worst["with_knowledge"], relative_error(call(rotated, x @ q.T, kq), want)
        )
        worst["input_only"] = max(
            worst["input_only"], relative_error(call(layer, x @ q.T, knowledge), want)
        )
    return worst


def permutation_error(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    *,
    convention: str,
    samples: int = 4,
    seed: int = 0,
) -> float:
    """Max over random permutations of the error of f(XP) = f(X)P (``"columns"``, the paper's
    Def. 4.1 on X ∈ R^{d×n}) or f(PX) = P f(X) (``"rows"``, the seed note's second proof).

    ``fn`` maps rows (B, n, F) -> (B, n, G). The two conventions are computed separately, the
    first through the column matrices X = xᵀ, so both the law and the layout are checked.
    """
    if convention not in ("columns", "rows"):
        raise ValueError(f"convention={convention!r} is unknown; use 'columns' or 'rows'")
    gen = torch.Generator().manual_seed(seed)
    ref = fn(x)
    worst = 0.0
    for _ in range(samples):
        p = random_permutation(x.shape[1], gen, x.dtype)  # (n, n)
        if convention == "columns":
            cols = x.transpose(1, 2)  # (B, F, n): X
            out = fn((cols @ p).transpose(1, 2)).transpose(1, 2)  # (B, G, n): f(XP)
            want = ref.transpose(1, 2) @ p  # (B, G, n): f(X)P
        else:
            out = fn(p @ x)  # (B, n, G): f(PX)
            want = p @ ref  # (B, n, G): P f(X)
        worst = max(worst, relative_error(out, want))
    return worst


def attention_identity_error(
    *, d_model: int = 12, heads: int = 3, n: int = 7, batch: int = 2, seed: int = 0
) -> float:
    """Standard multi-head self-attention == knowledge attention with Z = [W_Qᵀ, W_Kᵀ].

    The reference is ``torch.nn.MultiheadAttention`` (no biases); the knowledge layer has per
    head Z_i = [W_Q,iᵀ, W_K,iᵀ] (d × 2d₁), A = [[0, I], [0, 0]], scale 1/√d₁, W_V,i, W_out,i
    copied (Ma & Ying Sec. 2.2, Sec. 3.2). Last keys padded to test masking too. float64.
    """
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head_dim = d_model // heads
    mha = nn.MultiheadAttention(d_model, heads, bias=False, batch_first=True).double()
    w_q, w_k, w_v = mha.in_proj_weight.detach().chunk(3, dim=0)  # each (d, d)
    w_o = mha.out_proj.weight.detach()  # (d, d)
    score = QuadraticScore(
        heads=heads, knowledge=2 * head_dim, scale=1 / math.sqrt(head_dim), init="attention"
    )
    layer = KnowledgeAttention(
        d_model=d_model,
        heads=heads,
        knowledge=2 * head_dim,
        value_dim=head_dim,
        coefficients=Coefficients(score, SoftmaxNormalizer()),
    ).double()
    with torch.no_grad():
        for i in range(heads):
            rows = slice(i * head_dim, (i + 1) * head_dim)
            layer.z[i] = torch.cat([w_q[rows].T, w_k[rows].T], dim=1)  # (d, 2d₁)
            layer.w_value[i] = w_v[rows]  # (d₁, d)
            layer.w_out[i] = w_o[:, rows]  # (d, d₁)
    x = torch.randn(batch, n, d_model, generator=gen, dtype=torch.float64)
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[0, n - 2 :] = False  # two padded keys in the first sequence
    want, _ = mha(x, x, x, key_padding_mask=~mask, need_weights=False)
    return relative_error(layer(x, mask), want)


def remark41_errors(*, d_model: int = 6, half: int = 3, n: int = 5, seed: int = 0) -> dict:
    """Ma & Ying Remark 4.1: ρ/ψ that make the Prop. 4.1 form equal softmax attention.

    With Z = [W_Qᵀ, W_Kᵀ], y = Zᵀx and s(a, b) = aᵀ A b / √d₁ = q_a·k_b, softmax attention
    has weights S_r[j, i] = e^{s(y_j, y_i)} / Σ_l e^{s(y_j, y_l)} (query j, key i).

    ``as_printed``: the remark's ρ₂(x, y, ψ) = e^{s(x,y)}/(e^{s(x,y)} + ψ) with
    ψ₂ = e^{s(y, x)} summed over k ≠ i, j. Its off-diagonal entries miss the self term
    e^{s(y_i, y_i)} of the denominator (and the remark indexes g as S_r, not as the S_rᵀ that
    f = X g needs, cf. Eq. 2.1), so this error is not small. Compared with S_r here.
    ``corrected``: ρ₂(y_i, y_j, Σ) = e^{s(y_j,y_i)} / (e^{s(y_j,y_i)} + e^{s(y_j,y_j)} + Σ),
    ψ₂(y_k; y_i, y_j) = e^{s(y_j, y_k)}, ψ₁(y_k, y_i) = e^{s(y_i, y_k)},
    ρ₁(y_i, Σ) = e^{s(y_i,y_i)} / (e^{s(y_i,y_i)} + Σ): equals S_rᵀ as the coefficient of
    f = X g̃ to float precision. Also returns ``layer`` = the same through
    :class:`PermutationCoefficients` vs the softmax :class:`Coefficients`.
    """
    gen = torch.Generator().manual_seed(seed)
    dt = torch.float64
    k = 2 * half
    # small weights: a flat softmax, where the printed remark's missing self term shows most
    w_q = 0.3 * torch.randn(half, d_model, generator=gen, dtype=dt)
    w_k = 0.3 * torch.randn(half, d_model, generator=gen, dtype=dt)
    z = torch.cat([w_q.T, w_k.T], dim=1)  # (d, k)
    form = torch.zeros(k, k, dtype=dt)
    form[:half, half:] = torch.eye(half, dtype=dt)  # A = [[0, I], [0, 0]]
    scale = 1 / math.sqrt(half)

    def s(a, b):  # broadcastable (..., k) x (..., k) -> (..., 1)
        return scale * ((a @ form) * b).sum(-1, keepdim=True)

    x = torch.randn(1, n, d_model, generator=gen, dtype=dt)
    y = (x @ z)[:, None]  # (B, h=1, n, k)
    mask = torch.ones(1, n, dtype=torch.bool)
    inv = Invariants(y, mask)
    s_r = torch.softmax(s(y[..., :, None, :], y[..., None, :, :])[..., 0], dim=-1)  # [j, i]

    printed = PermutationCoefficients(
        psi2=lambda yk, yi, yj: s(yi, yk).exp(),
        rho2=lambda yi, yj, acc: s(yi, yj).exp() / (s(yi, yj).exp() + acc),
        psi1=lambda yk, yi: s(yi, yk).exp(),
        rho1=lambda yi, acc: s(yi, yi).exp() / (s(yi, yi).exp() + acc),
        normalize="none",
    )
    corrected = PermutationCoefficients(
        psi2=lambda yk, yi, yj: s(yj, yk).exp(),
        rho2=lambda yi, yj, acc: s(yj, yi).exp() / (s(yj, yi).exp() + s(yj, yj).exp() + acc),
        psi1=lambda yk, yi: s(yi, yk).exp(),
        rho1=lambda yi, acc: s(yi, yi).exp() / (s(yi, yi).exp() + acc),
        normalize="none",
    )
    g_printed = printed(inv).transpose(-1, -2)  # (1, 1, n, n): the remark's g_ij
    a_corrected = corrected(inv)  # (1, 1, n_j, n_i)
    quad = QuadraticScore(heads=1, knowledge=k, scale=scale, init="attention").double()
    a_layer = Coefficients(quad, SoftmaxNormalizer())(inv)
    return {
        "as_printed": relative_error(g_printed, s_r),
        "corrected": relative_error(a_corrected, s_r),
        "layer": relative_error(a_corrected, a_layer),
    }


def fixed_embedding_violation() -> float:
    """Ma & Ying Sec. 3.2: the fraction of single-digit expressions "a op b" whose answer breaks
    f(Q₁₂X) = Q₁₂ f(X) for the one-hot embedding and Q₁₂ swapping e₊, e₋. Near 1: the target
    of a fixed-embedding task is not orthogonal equivariant, hence the need for knowledge."""
    from symattn_cli.data.sequences import ARITHMETIC_TOKENS, arithmetic_item

    plus, minus = ARITHMETIC_TOKENS.index("+"), ARITHMETIC_TOKENS.index("-")
    swap = {plus: minus, minus: plus}
    bad = total = 0
    for a in range(10):
        for b in range(10):
            for op, other in (("+", "-"), ("-", "+")):
                _, answer = arithmetic_item(a, op, b, "single_digit")
                _, answer_swapped_input = arithmetic_item(a, other, b, "single_digit")
                q_answer = [swap.get(t, t) for t in answer]  # Q₁₂ f(X)
                bad += answer_swapped_input != q_answer
                total += 1
    return bad / total


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def model_orthogonal_errors(
    model: nn.Module, tokens: torch.Tensor, *, samples: int = 4, seed: int = 0
) -> dict[str, float]:
    """Invariance of a token model's logits under embedding rotations (Haar samples, max).

    ``with_knowledge``: logits(QE, QZ, QWQᵀ, QP, …) vs logits(E, …) (must be ~0);
    ``embedding_only``: logits(QE, Z, W, P, …) vs logits(E, …) (must be large).
    """
    from symattn_cli.models.knowledge import transform_embedding

    gen = torch.Generator().manual_seed(seed)
    d = model.embedding.shape[0]
    dtype = model.embedding.dtype
    with torch.no_grad():
        ref = model(tokens)
        worst = {"with_knowledge": 0.0, "embedding_only": 0.0}
        for _ in range(samples):
            q = haar_orthogonal(d, gen, dtype)
            full = transform_embedding(model, q)
            alone = transform_embedding(model, q, embedding_only=True)
            worst["with_knowledge"] = max(
                worst["with_knowledge"], relative_error(full(tokens), ref)
            )
            worst["embedding_only"] = max(
                worst["embedding_only"], relative_error(alone(tokens), ref)
            )
    return worst


def model_permutation_error(
    model: nn.Module, tokens: torch.Tensor, *, convention: str, samples: int = 4, seed: int = 0
) -> float:
    """:func:`permutation_error` of a token model, acting on one-hot tokens (no padding)."""
    vocab = model.embedding.shape[1]
    onehot = nn.functional.one_hot(tokens, vocab).to(model.embedding.dtype)  # (B, n, V)

    def fn(rows: torch.Tensor) -> torch.Tensor:
        return model(rows.argmax(-1))  # (B, n, V)

    with torch.no_grad():
        return permutation_error(fn, onehot, convention=convention, samples=samples, seed=seed)


def addition_example(*, causal: bool = False, reverse_answer: bool = True):
    """Six fixed additions (1–12 digits, padded batch) and their :class:`DataSpec`: tokens
    (6, n) with digits, '+', '=' and answer positions, for the indexed-position checks."""
    from symattn_cli.data.sequences import build

    options = {
        "num_train": 6,
        "num_val": 6,
        "num_test": 6,
        "max_digits": 4,
        "test_min_len": 5,
        "test_max_len": 12,
        "decoding": "causal" if causal else "one_pass",
        "reverse_answer": reverse_answer,
        "test_100_digits": 0,
        "test_1000_digits": 0,
    }
    bundle = build("addition", options, None)
    items = [bundle.test[i] for i in range(3)] + [
        bundle.extra_tests["test_long"][i] for i in range(3)
    ]
    tokens, _ = bundle.collate(items)  # (6, n)
    return tokens, bundle.spec


def long_addition_example(digits: int, *, count: int = 2, seed: int = 0) -> torch.Tensor:
    """``count`` causal additions of two ``digits``-digit operands (tokens (count, n)), for the
    checks of the windowed evaluation at lengths far beyond training."""
    return _long_additions(digits, count, seed)[0]


def addition_length_profile(
    model: nn.Module,
    lengths: Sequence[int],
    *,
    count: int = 100,
    seed: int = 0,
    batch_size: int = 64,
) -> list[dict]:
    """Greedy answers of a causal addition model per operand length: for each number of
    digits, ``count`` fresh additions (seeded, both operands that long); the share answered
    exactly and, for each wrong answer, the position of its first wrong digit (1 = units)."""
    model = model.eval()
    profile = []
    for digits in lengths:
        tokens, targets = _long_additions(digits, count, seed)  # (count, n) each
        first_wrong = []
        with torch.no_grad():
            for lo in range(0, count, batch_size):
                pred = model(tokens[lo : lo + batch_size]).argmax(-1)  # (b, n)
                want = targets[lo : lo + batch_size]  # (b, n)
                read = want != IGNORE_INDEX
                wrong = (pred != want) & read  # (b, n)
                for row in range(wrong.shape[0]):
                    if wrong[row].any():
                        answer = wrong[row][read[row]]  # answer digits, units first
                        first_wrong.append(int(answer.nonzero()[0]) + 1)
        profile.append({"digits": digits, "exact": 1 - len(first_wrong) / count,
                        "first_wrong": sorted(first_wrong)})  # fmt: skip
    return profile


def _long_additions(digits: int, count: int, seed: int):
    from symattn_cli.data.sequences import build

    options = {"num_train": 1, "num_val": 1, "num_test": 1, "max_digits": 4,
               "test_100_digits": digits, "num_test_100": count, "test_1000_digits": 0,
               "decoding": "causal", "split_seed": seed}  # fmt: skip
    bundle = build("addition", options, None)
    return bundle.collate([bundle.extra_tests["test_100"][i] for i in range(count)])


def windowed_dense_error(model: nn.Module, tokens: torch.Tensor) -> float:
    """A ``relative_window`` model's greedy logits over listed window pairs against those of the
    dense (B, n, n) masks, at the real tokens (must be ~0: the same function)."""
    model = model.eval()
    real = tokens != model.pad_index  # (B, n)
    with torch.no_grad():
        windowed = model(tokens, windowed=True)[real]
        return relative_error(windowed, model(tokens, windowed=False)[real])


def position_shift_change(model: nn.Module, tokens: torch.Tensor, *, shift: int = 1) -> float:
    """Non-degeneracy of an indexed position: ‖logits(c + shift) − logits(c)‖ / ‖logits(c)‖,
    every non-zero position index c moved by ``shift`` (must be large: the model sees its
    positions). Evaluation mode, no random offset."""
    model = model.eval()
    with torch.no_grad():
        return relative_error(model(tokens, position_shift=shift), model(tokens))


def relative_index_changes(model: nn.Module, tokens: torch.Tensor) -> dict[str, float]:
    """The relative index scores of ``model`` (``relative_span`` > 0, indexed positions), on a
    copy whose position vectors are removed (frame F = 0), so that positions reach it through
    the relative term only: ``shift``, the change when every index moves by one (0: a
    function of index differences), and ``removed``, the change when the term is zeroed
    (large: the model reads it)."""
    model = copy.deepcopy(model).eval()
    with torch.no_grad():
        if model.position is not None:  # position=relative has no vectors
            model.position.frame.zero_()
        shift = position_shift_change(model, tokens)
        ref = model(tokens)
        for block in model.blocks:
            block.attention.relative_bias.zero_()
        removed = relative_error(model(tokens), ref)
    return {"shift": shift, "removed": removed}


def causal_leak(model: nn.Module, tokens: torch.Tensor) -> float:
    """Causal answers: the largest change of the logits at positions ≤ t when every answer
    token after t is replaced (t = the second answer position of each sequence), one
    teacher-forced pass. Must be 0: no position reads a later answer token."""
    model = model.eval()
    with torch.no_grad():
        layout = model.layout(tokens)
        n = tokens.shape[1]
        pos = torch.arange(n)[None, :]  # (1, n)
        start = torch.where(layout.answer, pos, n).amin(-1, keepdim=True)  # (B, 1)
        later = layout.answer & (pos > start + 1)  # (B, n)
        vocab = model.embedding.shape[1]
        other = (tokens + 1 - model.pad_index) % (vocab - 1) + model.pad_index + 1  # ≠ token
        other = torch.where(other >= vocab, other - vocab + 1, other)  # (B, n), never pad
        changed = torch.where(later, other, tokens)  # (B, n)
        ref = model.logits(tokens, layout)  # (B, n, V)
        out = model.logits(changed, layout)  # (B, n, V)
        keep = ~later & layout.real  # (B, n)
        return relative_error(out[keep], ref[keep])


def _predict(model, batches) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    preds, logits_all, targets = [], [], []
    with torch.no_grad():
        for tokens, target in batches:
            logits = model(tokens)  # (B, n, V)
            logits_all.append(logits.flatten(0, 1))
            preds.append(logits.argmax(-1).flatten())
            targets.append(target.flatten())
    return torch.cat(preds), torch.cat(logits_all), torch.cat(targets)


def _accuracies(model, batches) -> tuple[float, float]:
    right = total = exact = seqs = 0
    with torch.no_grad():
        for tokens, target in batches:
            pred = model(tokens).argmax(-1)  # (B, n)
            keep = target != IGNORE_INDEX
            hit = (pred == target) & keep
            right += int(hit.sum())
            total += int(keep.sum())
            exact += int((hit | ~keep).all(-1).sum())
            seqs += tokens.shape[0]
    return right / max(total, 1), exact / max(seqs, 1)


def embedding_transfer(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    samples: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> dict[str, float]:
    """Evaluate a trained token model in rotated embeddings (Ma & Ying Sec. 3.2, Def. 3.2).

    For ``samples`` Haar-random Q: the model with embedding *and* knowledge rotated makes
    exactly the same predictions (``rotated_*``: the worst sample, equal to the original;
    ``agreement`` = 1; ``logit_error`` ~ 1e-15 in float64); with the token embedding rotated
    alone, accuracy drops towards chance (``embedding_only_*``: mean over the samples).
    Chance levels: ``chance_token_acc`` = 1 / (number of distinct answer tokens),
    ``majority_token_acc`` = frequency of the most common answer token.
    ``batches``: an iterable of ``(tokens, targets)`` (e.g. a DataLoader with the bundle's
    collate); it is materialised once. The model is copied, never modified.
    """
    import copy

    from symattn_cli.models.knowledge import transform_embedding

    batches = list(batches)
    base = copy.deepcopy(model).to(dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    pred, logits, target = _predict(base, batches)
    keep = target != IGNORE_INDEX
    tok, exact = _accuracies(base, batches)
    worst_tok, worst_exact, agreement, logit_error = 1.0, 1.0, 1.0, 0.0
    alone_tok, alone_exact = [], []
    for _ in range(samples):
        q = haar_orthogonal(base.embedding.shape[0], gen, dtype)
        full = transform_embedding(base, q).eval()
        alone = transform_embedding(base, q, embedding_only=True).eval()
        pred_full, logits_full, _ = _predict(full, batches)
        tok_full, exact_full = _accuracies(full, batches)
        worst_tok, worst_exact = min(worst_tok, tok_full), min(worst_exact, exact_full)
        agreement = min(agreement, float((pred_full[keep] == pred[keep]).double().mean()))
        logit_error = max(logit_error, relative_error(logits_full, logits))
        tok_alone, exact_alone = _accuracies(alone, batches)
        alone_tok.append(tok_alone)
        alone_exact.append(exact_alone)
    answers, counts = torch.unique(target[keep], return_counts=True)
    return {
        "token_acc": tok,
        "exact_acc": exact,
        "rotated_token_acc": worst_tok,
        "rotated_exact_acc": worst_exact,
        "agreement": agreement,
        "logit_error": logit_error,
        "embedding_only_token_acc": sum(alone_tok) / len(alone_tok),
        "embedding_only_exact_acc": sum(alone_exact) / len(alone_exact),
        "chance_token_acc": 1.0 / max(len(answers), 1),
        "majority_token_acc": float(counts.max()) / max(int(keep.sum()), 1),
    }
