"""Knowledge attention (Ma & Ying 2023): seq2seq layers O(d)-equivariant with knowledge.

Layout, stated once. The paper writes a sequence as columns, X ∈ R^{d×n}, and knowledge as
Z ∈ R^{d×k}. This code stores sequences as rows, ``x`` of shape (B, n, d): row t of ``x[b]`` is
the paper's column x_t, i.e. ``X = x[b].T``. The translations used everywhere below:

    paper                    rows (this code)
    X ∈ R^{d×n}              x: (B, n, d)
    QX (Q ∈ O(d))            x @ Q.T
    XP (P ∈ S_n, columns)    P.T @ x
    Zᵀ X ∈ R^{k×n}           y = x @ Z: (B, h, n, k)   (one Z_i per head)
    f(X) = X g,  g ∈ R^{n×n}  out = a @ x with a = gᵀ, a[j, i] = g_{ij}

so ``a[..., j, i]`` is the weight of input token i in output token j (query j, key i), and a
softmax "over rows" S_r of the paper is a softmax over the last (key) axis here: the paper's
self-attention Eq. (2.1) reads X + W_V X S_rᵀ, whose S_rᵀ is exactly our ``a``.

Letters: B batch, n tokens (queries j, keys i), m external knowledge vectors, d embedding,
h heads, k knowledge vectors per head (columns of Z_i), u keys of the general form (n tokens
then k knowledge vectors), v value width, p ψ-feature width, F invariant features, H hidden
width, V vocabulary.

Transformation laws (checked numerically in :mod:`symattn_cli.verify.knowledge`):

* orthogonal equivariance with knowledge (Def. 3.2): every parameter with an index in the
  embedding space is knowledge; each such index moves with Q (Z → QZ, a map W → QWQᵀ,
  an MLP V σ(U ·) → (QV) σ(UQᵀ ·)). Each module below lists, in ``embedding_axes``, which
  axes of each of its parameters are embedding indices, and :func:`rotate_embedding` applies Q
  to exactly those. f(QX, QZ, QWQᵀ) = Q f(X, Z, W).
* element-wise permutation equivariance (Def. 4.1): without a position encoding every layer
  here satisfies f(XP) = f(X)P, equivalently f(PX) = P f(X) in rows.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

Activation = Callable[[torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------------------------
# Embedding-space bookkeeping: which parameter axes are embedding indices
# --------------------------------------------------------------------------------------------


def rotate_axes(tensor: torch.Tensor, q: torch.Tensor, axes: Iterable[int]) -> torch.Tensor:
    """Apply the orthogonal ``q`` (d, d) to each listed axis: t'_{..a..} = Σ_c q_{ac} t_{..c..}.

    For a map W with both indices in the embedding space this is Q W Qᵀ; for a row-layout
    matrix whose axis 1 is the embedding (e.g. W_V: (v, d)) it is W_V Qᵀ.
    """
    out = tensor
    for axis in axes:
        out = torch.tensordot(q, out, dims=([1], [axis]))  # axis moved to the front
        out = torch.movedim(out, 0, axis)  # back in place
    return out


def rotate_embedding(
    module: nn.Module,
    q: torch.Tensor,
    include: Callable[[str], bool] | None = None,
) -> nn.Module:
    """A deep copy of ``module`` with Q applied to every embedding-space parameter index.

    Shapes (d embedding): ``q`` ``(d, d)`` orthogonal; each parameter keeps its shape, each
    axis listed in its module's ``embedding_axes`` is multiplied by Q (:func:`rotate_axes`),
    so a module of this file satisfies ``rotate_embedding(f, Q)(x Qᵀ) = f(x) Qᵀ`` for
    sequences ``x`` ``(B, n, d)`` (Def. 3.2, in rows).

    ``include(name)`` (dotted parameter name) restricts the rotation to some parameters, e.g.
    the token embedding alone for the negative control. Every module that owns parameters
    must declare ``embedding_axes`` for each of them (an empty tuple: invariant, e.g. a
    quadratic form A acting on knowledge coordinates); an undeclared parameter raises
    ``TypeError``, so a new layer cannot silently escape the transformation law.
    """
    rotated = copy.deepcopy(module)
    with torch.no_grad():
        for prefix, sub in rotated.named_modules():
            own = dict(sub.named_parameters(recurse=False))
            if not own:
                continue
            declared = getattr(type(sub), "embedding_axes", None)
            if declared is None:
                raise TypeError(
                    f"{type(sub).__name__} at {prefix or '<root>'} owns parameters "
                    f"{sorted(own)} but declares no embedding_axes; declare them"
                )
            for name, param in own.items():
                if name not in declared:
                    raise TypeError(
                        f"{type(sub).__name__}.{name} has no entry in embedding_axes; declare "
                        "its embedding-space axes (an empty tuple if it is invariant)"
                    )
                full = f"{prefix}.{name}" if prefix else name
                axes = declared[name]
                if axes and (include is None or include(full)):
                    param.copy_(rotate_axes(param, q.to(param), axes))
    return rotated


# --------------------------------------------------------------------------------------------
# Small networks of invariants (parameters act on invariant coordinates only)
# --------------------------------------------------------------------------------------------


class PairPooledActivation(torch.autograd.Function):
    """S_ij = Σ_k r_k σ(a_k + b_i + c_j): the hidden sum over k of a network on triples.

    a, b, c (B, h, n, H): the per-token first-layer terms of the k, i and j arguments; r (B, n)
    weights over k (the real-token mask); S (B, h, n_i, n_j, H). Formed one query i at a time,
    forward and backward (where each slice's activations are formed again), so no
    (B, h, n, n, n, H) tensor is held: memory O(n²H) in place of O(n³H).
    """

    @staticmethod
    def forward(ctx, a, b, c, r, activation):
        ctx.save_for_backward(a, b, c, r)
        ctx.activation = activation
        bsz, heads, n, width = a.shape
        rows = r[:, None, None, :].to(a.dtype)  # (B, 1, 1, n_k)
        out = a.new_empty(bsz, heads, n, n, width)
        for i in range(n):
            act = activation(a[:, :, :, None] + (b[:, :, i, None, None] + c[:, :, None, :]))
            out[:, :, i] = torch.matmul(rows, act.reshape(bsz, heads, n, -1)).reshape(
                bsz, heads, n, width
            )  # act: (B, h, n_k, n_j, H)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        a, b, c, r = ctx.saved_tensors
        weight = r.to(a.dtype)[:, None, :, None, None]  # (B, 1, n_k, 1, 1)
        da, db, dc = torch.zeros_like(a), torch.zeros_like(b), torch.zeros_like(c)
        for i in range(a.shape[2]):
            with torch.enable_grad():
                pre = (a[:, :, :, None] + (b[:, :, i, None, None] + c[:, :, None, :])).detach()
                pre.requires_grad_(True)
                act = ctx.activation(pre)  # (B, h, n_k, n_j, H)
                (dpre,) = torch.autograd.grad(act, pre, weight * grad[:, :, i, None])
            da += dpre.sum(3)
            db[:, :, i] = dpre.sum((2, 3))
            dc += dpre.sum(2)
        return da, db, dc, None, None


def pair_pooled_activation(a, b, c, r, activation):
    """:class:`PairPooledActivation` in eager mode; under torch.compile the same sum written
    whole, (B, h, n, n, n, H) at once, which the compiler differentiates and may fuse."""
    if not torch.compiler.is_compiling():
        return PairPooledActivation.apply(a, b, c, r, activation)
    act = activation(a[:, :, :, None, None] + (b[:, :, None, :, None] + c[:, :, None, None, :]))
    return torch.einsum("bk,bhkijw->bhijw", r.to(a.dtype), act)


class HeadwiseMLP(nn.Module):
    """A one-hidden-layer network per head on a concatenation of broadcastable arguments.

    ``forward(*args)``: each argument has shape (B, h, ..., F_a) with the head at axis 1; the
    first layer is applied per argument and the results are broadcast-added, so ψ(y_k, y_i, y_j)
    over all (k, i, j) costs one (n, n, n, H) activation instead of concatenating copies.
    Parameters act on invariant features only: they do not move with Q.
    """

    embedding_axes = {"first": (), "bias": (), "second": (), "out_bias": ()}

    def __init__(
        self,
        *,
        heads: int,
        in_features: Iterable[int],
        hidden: int,
        out_features: int,
        activation: Activation,
    ) -> None:
        super().__init__()
        self.in_features = tuple(in_features)
        total = sum(self.in_features)
        self.first = nn.Parameter(torch.randn(heads, total, hidden) / math.sqrt(total))
        self.bias = nn.Parameter(torch.zeros(heads, hidden))
        self.second = nn.Parameter(torch.randn(heads, hidden, out_features) / math.sqrt(hidden))
        self.out_bias = nn.Parameter(torch.zeros(heads, out_features))
        self.activation = activation

    def project(self, *args: torch.Tensor) -> list[torch.Tensor]:
        """The first layer per argument: (B, h, ..., F_a) -> (B, h, ..., H), bias not added."""
        if len(args) != len(self.in_features):
            raise ValueError(f"expected {len(self.in_features)} arguments, got {len(args)}")
        terms = []
        for weight, arg in zip(torch.split(self.first, self.in_features, dim=1), args, strict=True):
            bsz, heads, *between, feat = arg.shape
            flat = arg.reshape(bsz, heads, -1, feat)  # (B, h, S, F): S = the broadcast axes
            term = torch.einsum("bhsf,hfH->bhsH", flat, weight)  # (B, h, S, H)
            terms.append(term.reshape(bsz, heads, *between, -1))  # (B, h, ..., H)
        return terms

    def readout(self, hidden: torch.Tensor, count: torch.Tensor | float = 1.0) -> torch.Tensor:
        """second-layer map of a sum of ``count`` hidden activations: Σ σ(·) W₂ + count b₂.

        ``hidden`` (B, h, ..., H); ``count`` broadcastable to (B, h, ...). The second layer is
        affine, so the sum of the network's outputs is the readout of its hidden sum.
        """
        bsz, heads, *between, width = hidden.shape
        flat = hidden.reshape(bsz, heads, -1, width)  # (B, h, S, H)
        out = torch.einsum("bhsH,hHo->bhso", flat, self.second).reshape(bsz, heads, *between, -1)
        count = torch.as_tensor(count, dtype=hidden.dtype, device=hidden.device)
        ones = (1,) * len(between)
        return out + count[..., None] * self.out_bias.reshape(heads, *ones, -1)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        pre = None
        for term in self.project(*args):
            pre = term if pre is None else pre + term  # broadcast-add over the arguments
        heads, hidden = self.bias.shape
        ones = (1,) * (pre.dim() - 3)
        return self.readout(self.activation(pre + self.bias.reshape(heads, *ones, hidden)))


# --------------------------------------------------------------------------------------------
# Coefficient functions g: invariants -> weights a (B, h, n, keys)
# --------------------------------------------------------------------------------------------


class Invariants:
    """The O(d)-invariant inputs of g for one call (Prop. 3.2): ZᵀX and, when asked, XᵀX, ZᵀZ.

    ``zx`` (B, h, n, k): y = Z_iᵀ X per head, in rows; ``xx`` (B, n, n); ``zz`` (B, h, k, k);
    ``mask`` (B, n) True at real (non-padded) tokens, or (B, n, n) True where query j may read
    key i (causal decoding; the normalised score forms only, see :func:`broadcast_mask`);
    ``bias`` (B, h, n, n): a score term of the token indices alone (invariant), or None.
    """

    def __init__(self, zx, mask, xx=None, zz=None, bias=None) -> None:
        self.zx, self.mask, self.xx, self.zz, self.bias = zx, mask, xx, zz, bias


class Score(nn.Module):
    """Base of the score functions s(Y) (B, h, n, n) of the simplified form g(ZᵀX).

    ``pairs(yq, yk)``: the same s for listed pairs only (windowed attention, :class:`KeyRows`):
    query rows yq (B, h, r, k) and their keys yk (B, h, r, m, k) -> (B, h, r, m).
    """

    embedding_axes: dict[str, tuple[int, ...]] = {}

    def pairs(self, yq: torch.Tensor, yk: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} scores all tokens at once: no windowed form")


class QuadraticScore(Score):
    """s_ji = scale · y_jᵀ A y_i: the quadratic form of Eq. (3.2), YᵀAY in the paper.

    Shapes (B batch, h heads, n tokens, k knowledge per head): y = ZᵀX ``(B, h, n, k)`` ->
    scores ``(B, h, n, n)``; A ``(h, k, k)``. A acts on knowledge coordinates: invariant.

    Options (keyword-only): ``heads`` h, ``knowledge`` k, ``scale`` (e.g. 1/√(k/2));
    ``init``: ``"attention"`` (default, k even: A = [[0, I], [0, 0]] (Sec. 3.2), which makes
    Z = [W_Qᵀ, W_Kᵀ] standard attention) or ``"random"``.
    """

    embedding_axes = {"form": ()}

    def __init__(self, *, heads: int, knowledge: int, scale: float, init: str = "attention"):
        super().__init__()
        if init == "attention":
            if knowledge % 2:
                raise ValueError(f"knowledge={knowledge} must be even for A = [[0, I], [0, 0]]")
            half = knowledge // 2
            form = torch.zeros(heads, knowledge, knowledge)
            form[:, :half, half:] = torch.eye(half)
        elif init == "random":
            form = torch.randn(heads, knowledge, knowledge) / math.sqrt(knowledge)
        else:
            raise ValueError(f"init={init!r} is unknown; use 'attention' or 'random'")
        self.form = nn.Parameter(form)
        self.scale = scale

    def forward(self, inv: Invariants) -> torch.Tensor:
        y = inv.zx
        left = torch.einsum("bhjk,hkl->bhjl", y, self.form)  # (B, h, n, k)
        return self.scale * torch.einsum("bhjl,bhil->bhji", left, y)  # (B, h, n, n)

    def pairs(self, yq: torch.Tensor, yk: torch.Tensor) -> torch.Tensor:
        left = torch.einsum("bhrk,hkl->bhrl", yq, self.form)  # (B, h, r, k)
        return self.scale * torch.einsum("bhrl,bhrml->bhrm", left, yk)  # (B, h, r, m)


class InnerProductScore(Score):
    """s_ji = scale · y_jᵀ y_i: the inner-product kernel K(y_j, y_i) = σ(y_jᵀy_i) (Sec. 3.3)."""

    def __init__(self, *, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, inv: Invariants) -> torch.Tensor:
        return self.scale * torch.einsum("bhjk,bhik->bhji", inv.zx, inv.zx)  # (B, h, n, n)

    def pairs(self, yq: torch.Tensor, yk: torch.Tensor) -> torch.Tensor:
        return self.scale * torch.einsum("bhrk,bhrmk->bhrm", yq, yk)  # (B, h, r, m)


class RBFScore(Score):
    """s_ji = −γ_h ‖y_j − y_i‖²; exp or softmax of it: the RBF kernel φ(‖y_i − y_j‖) (Sec. 3.3).

    γ_h = scale · exp(log_gamma_h) > 0 is learned per head (invariant).
    """

    embedding_axes = {"log_gamma": ()}

    def __init__(self, *, heads: int, scale: float):
        super().__init__()
        self.log_gamma = nn.Parameter(torch.zeros(heads))
        self.scale = scale

    def forward(self, inv: Invariants) -> torch.Tensor:
        y = inv.zx
        sq = (y * y).sum(-1)  # (B, h, n)
        cross = torch.einsum("bhjk,bhik->bhji", y, y)  # (B, h, n, n)
        dist2 = (sq[..., :, None] + sq[..., None, :] - 2 * cross).clamp_min(0)  # (B, h, n, n)
        gamma = self.scale * self.log_gamma.exp()[None, :, None, None]  # (1, h, 1, 1)
        return -gamma * dist2

    def pairs(self, yq: torch.Tensor, yk: torch.Tensor) -> torch.Tensor:
        sq_q, sq_k = (yq * yq).sum(-1), (yk * yk).sum(-1)  # (B, h, r), (B, h, r, m)
        cross = torch.einsum("bhrk,bhrmk->bhrm", yq, yk)  # (B, h, r, m)
        dist2 = (sq_q[..., None] + sq_k - 2 * cross).clamp_min(0)  # (B, h, r, m)
        gamma = self.scale * self.log_gamma.exp()[None, :, None, None]  # (1, h, 1, 1)
        return -gamma * dist2


class QuarticScore(QuadraticScore):
    """Quadratic plus the next term of Eq. (3.2): Yᵀ A Y + Yᵀ B (Y Yᵀ / n) C Y.

    The quartic product Yᵀ B Y Yᵀ C Y is the K_i = 4 term of Eq. (3.2) (the middle Y Yᵀ is
    Σ_t y_t y_tᵀ over real tokens); dividing it by the number of real tokens n keeps its size
    independent of n. B, C act on knowledge coordinates and start at zero, so training starts
    from the quadratic (attention) form. Permutation invariant in the middle sum.
    """

    embedding_axes = {"form": (), "left4": (), "right4": ()}

    def __init__(self, *, heads: int, knowledge: int, scale: float, init: str = "attention"):
        super().__init__(heads=heads, knowledge=knowledge, scale=scale, init=init)
        self.left4 = nn.Parameter(torch.zeros(heads, knowledge, knowledge))
        self.right4 = nn.Parameter(torch.randn(heads, knowledge, knowledge) / math.sqrt(knowledge))

    def forward(self, inv: Invariants) -> torch.Tensor:
        y = inv.zx
        maskf = token_mask(inv.mask, "the quartic form's moment").to(y.dtype)  # (B, n)
        count = maskf.sum(-1).clamp_min(1)[:, None, None, None]  # (B, 1, 1, 1)
        moment = torch.einsum("bhtk,bhtl,bt->bhkl", y, y, maskf) / count  # (B, h, k, k)
        middle = torch.einsum("hkl,bhlm,hmo->bhko", self.left4, moment, self.right4)  # (B,h,k,k)
        left = torch.einsum("bhjk,bhko->bhjo", y, middle)  # (B, h, n, k)
        quartic = torch.einsum("bhjo,bhio->bhji", left, y)  # (B, h, n, n)
        return super().forward(inv) + self.scale * self.scale * quartic

    def pairs(self, yq: torch.Tensor, yk: torch.Tensor) -> torch.Tensor:
        return Score.pairs(self, yq, yk)  # the moment sums over every token


def broadcast_mask(mask: torch.Tensor) -> torch.Tensor:
    """The mask broadcast against scores (B, h, n, keys): (B, 1, 1, keys) or (B, 1, n, keys).

    A (B, n) mask marks real keys; a (B, n, keys) mask says, per query, which keys it reads.
    """
    return mask[:, None, None, :] if mask.dim() == 2 else mask[:, None]


def token_mask(mask: torch.Tensor, what: str) -> torch.Tensor:
    """The (B, n) real-token mask of forms that sum over tokens; a per-query mask is refused."""
    if mask.dim() != 2:
        raise ValueError(
            f"{what} sums over all tokens, so it cannot read them causally (a (B, n, n) mask); "
            "use the softmax, sigmoid, kernel or rbf form for causal decoding"
        )
    return mask


class SoftmaxNormalizer(nn.Module):
    """a_ji = softmax over real keys i of s_ji (the paper's S_r, transposed into ``a``).

    Shapes (B batch, h heads, n tokens, u keys): ``forward(scores, mask)``: scores
    ``(B, h, n, u)`` and mask ``(B, u)`` or ``(B, n, u)`` (True: real key) -> ``(B, h, n, u)``.
    Permuting the tokens permutes both axes alike; no options.
    """

    def forward(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keep = broadcast_mask(mask)  # (B, 1, 1 or n, keys)
        scores = scores.masked_fill(~keep, float("-inf"))
        return torch.softmax(scores, dim=-1)


class ElementwiseNormalizer(nn.Module):
    """a_ji = σ(s_ji) at real keys, 0 at padding: the element-wise nonlinearity of Eq. (3.2).

    ``mean=True`` divides by the number of real keys (a scalar, no parameter), which keeps the
    output size independent of n for length generalisation.
    """

    def __init__(self, activation: Activation, *, mean: bool = False):
        super().__init__()
        self.activation = activation
        self.mean = mean

    def forward(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keep = broadcast_mask(mask).to(scores.dtype)  # (B, 1, 1 or n, keys)
        weights = self.activation(scores) * keep
        if self.mean:
            weights = weights / keep.sum(-1, keepdim=True).clamp_min(1)
        return weights


class Coefficients(nn.Module):
    """g(ZᵀX) = normalizer(score(ZᵀX)): the simplified form's coefficients (Sec. 3.2–3.3).

    Shapes (B batch, h heads, n tokens, k knowledge per head): invariants with y = ZᵀX
    ``(B, h, n, k)`` -> weights a ``(B, h, n, n)``, a[..., j, i] the weight of key i in
    query j. Options: ``score`` (e.g. :class:`QuadraticScore`) and ``normalizer`` (e.g.
    :class:`SoftmaxNormalizer`), both modules.

    Satisfies g(Zᵀ(QX)) with Z → QZ unchanged (it sees ZᵀX only) and, with no position
    information, g(P·) = P g(·) Pᵀ on its two token axes. Parameter count independent of n
    (Assumption 3.1).
    """

    embedding_axes: dict[str, tuple[int, ...]] = {}
    uses_gram = False  # needs XᵀX and ZᵀZ (general form only)
    knowledge_keys = False  # keys include the knowledge vectors (the Z g₂ term)

    def __init__(self, score: Score, normalizer: nn.Module):
        super().__init__()
        self.score = score
        self.normalizer = normalizer

    def forward(self, inv: Invariants) -> torch.Tensor:
        scores = self.score(inv)  # (B, h, n, n)
        if inv.bias is not None:
            scores = scores + inv.bias
        return self.normalizer(scores, inv.mask)  # (B, h, n, n)


class GeneralCoefficients(nn.Module):
    """[g₁; g₂](XᵀX, ZᵀX, ZᵀZ) of Ma & Ying Prop. 3.2, Eq. (3.1), read as X̃ g(X̃ᵀX̃), X̃ = [X, Z].

    For output token j and key u (a token x_i, or a knowledge vector z_a) the weight is a
    small per-head network of invariants only:
    φ(x_jᵀx̃_u, x̃_uᵀx̃_u, x_jᵀx_j, Zᵀx_j, Zᵀx̃_u, [u is knowledge]) (F = 2k + 4 numbers,
    inner products divided by d), normalised by a softmax over the n + k keys. Its parameter
    count depends on k and the hidden width, never on n (Assumption 3.1). The first n key
    columns are g₁ᵀ, the last k are g₂ᵀ.
    """

    embedding_axes: dict[str, tuple[int, ...]] = {}
    uses_gram = True
    knowledge_keys = True

    def __init__(
        self, *, heads: int, knowledge: int, hidden: int, activation: Activation, d_model: int
    ):
        super().__init__()
        self.net = HeadwiseMLP(
            heads=heads,
            in_features=(3, knowledge, knowledge, 1),
            hidden=hidden,
            out_features=1,
            activation=activation,
        )
        self.inv_scale = 1.0 / d_model
        self.normalizer = SoftmaxNormalizer()

    def forward(self, inv: Invariants) -> torch.Tensor:
        zx, xx, zz = inv.zx, inv.xx, inv.zz  # (B,h,n,k), (B,n,n), (B,h,k,k)
        bsz, heads, n, k = zx.shape
        s = self.inv_scale
        diag_x = torch.diagonal(xx, dim1=-2, dim2=-1)  # (B, n): x_jᵀx_j
        diag_z = torch.diagonal(zz, dim1=-2, dim2=-1)  # (B, h, k): z_aᵀz_a
        # pairwise scalars (x_jᵀx̃_u, x̃_uᵀx̃_u, x_jᵀx_j) for u = tokens then knowledge
        tok = torch.stack(
            [xx, diag_x[:, None, :].expand(bsz, n, n), diag_x[:, :, None].expand(bsz, n, n)], -1
        )  # (B, n_j, n_i, 3)
        tok = tok[:, None].expand(bsz, heads, n, n, 3)  # (B, h, n, n, 3)
        kno = torch.stack(
            [
                zx,  # x_jᵀ z_a: (B, h, n_j, k_a)
                diag_z[:, :, None, :].expand(bsz, heads, n, k),
                diag_x[:, None, :, None].expand(bsz, heads, n, k),
            ],
            -1,
        )  # (B, h, n, k, 3)
        pair = s * torch.cat([tok, kno], dim=3)  # (B, h, n, n+k, 3)
        key_proj = s * torch.cat([zx, zz.transpose(-1, -2)], dim=2)  # (B, h, n+k, k): Zᵀx̃_u
        query_proj = s * zx  # (B, h, n, k): Zᵀx_j
        flag = torch.cat([zx.new_zeros(n), zx.new_ones(k)])  # (n+k,)
        flag = flag.reshape(1, 1, 1, n + k, 1).expand(bsz, heads, 1, n + k, 1)
        scores = self.net(
            pair, query_proj[:, :, :, None, :], key_proj[:, :, None, :, :], flag
        ).squeeze(-1)  # (B, h, n, n+k)
        mask = token_mask(inv.mask, "the general form")
        keys = torch.cat([mask, mask.new_ones(bsz, k)], dim=1)  # (B, n+k)
        return self.normalizer(scores, keys)


class PermutationCoefficients(nn.Module):
    """g̃(ZᵀX) in the ρ/ψ form of Ma & Ying Prop. 4.1 (O(n³) in the sequence length).

    g̃_ii = ρ₁(Zᵀx_i, Σ_{k≠i} ψ₁(Zᵀx_k, Zᵀx_i)),
    g̃_ij = ρ₂(Zᵀx_i, Zᵀx_j, Σ_{k≠i,j} ψ₂(Zᵀx_k, Zᵀx_i, Zᵀx_j))   (i ≠ j),
    f(X, Z) = X g̃, so a[j, i] = g̃_ij. ρ, ψ are callables on broadcastable (B, h, …, k)
    tensors (learned :class:`HeadwiseMLP` by default; :mod:`symattn_cli.verify.knowledge`
    passes the closed forms of Remark 4.1). ``normalize="softmax"`` passes g̃ through a
    softmax over keys (still permutation equivariant, hence still of Prop. 4.1's form);
    ``"none"`` returns g̃ as written. Sums run over real (non-padded) tokens only.
    """

    embedding_axes: dict[str, tuple[int, ...]] = {}
    uses_gram = False
    knowledge_keys = False

    def __init__(self, *, rho1, psi1, rho2, psi2, normalize: str = "softmax"):
        super().__init__()
        if normalize not in ("softmax", "none"):
            raise ValueError(f"normalize={normalize!r} is unknown; use 'softmax' or 'none'")
        self.rho1, self.psi1, self.rho2, self.psi2 = rho1, psi1, rho2, psi2
        self.normalize = normalize

    @classmethod
    def learned(
        cls,
        *,
        heads: int,
        knowledge: int,
        features: int,
        hidden: int,
        activation: Activation,
        normalize: str = "softmax",
    ) -> PermutationCoefficients:
        def mlp(parts, out):
            return HeadwiseMLP(
                heads=heads,
                in_features=parts,
                hidden=hidden,
                out_features=out,
                activation=activation,
            )

        k, p = knowledge, features
        return cls(
            psi1=mlp((k, k), p),
            rho1=mlp((k, p), 1),
            psi2=mlp((k, k, k), p),
            rho2=mlp((k, k, p), 1),
            normalize=normalize,
        )

    def forward(self, inv: Invariants) -> torch.Tensor:
        y, mask = inv.zx, token_mask(inv.mask, "the Prop. 4.1 form")  # (B, h, n, k), (B, n)
        n = y.shape[2]
        eye = torch.eye(n, dtype=torch.bool, device=y.device)
        real = mask.to(y.dtype)  # (B, n_k)
        if isinstance(self.psi1, HeadwiseMLP) and isinstance(self.psi2, HeadwiseMLP):
            sum1, sum2 = self._mlp_sums(y, real)
        else:
            sum1, sum2 = self._sums(y, real, eye)
        diag = self.rho1(y, sum1)[..., 0]  # (B, h, n_i)
        off = self.rho2(y[:, :, :, None, :], y[:, :, None, :, :], sum2)[..., 0]  # (B,h,n_i,n_j)
        g = torch.where(eye, torch.diag_embed(diag), off)  # (B, h, n_i, n_j): g̃_ij
        a = g.transpose(-1, -2)  # (B, h, n_j, n_i): a[j, i] = g̃_ij
        if self.normalize == "softmax":
            return SoftmaxNormalizer()(a, mask)
        return a * mask[:, None, None, :].to(a.dtype)

    def _sums(self, y: torch.Tensor, real: torch.Tensor, eye: torch.Tensor):
        """Σ_{k≠i} ψ₁(y_k, y_i) (B, h, n_i, p) and Σ_{k≠i,j} ψ₂(y_k, y_i, y_j) (B, h, n_i, n_j, p)
        over real k, for any callables ψ: every term is formed, then masked and summed."""
        real_k = real[:, None, :, None]  # (B, 1, n_k, 1)
        psi1 = self.psi1(y[:, :, :, None, :], y[:, :, None, :, :])  # (B, h, n_k, n_i, p)
        keep1 = real_k * (~eye).to(y.dtype)  # (B, 1, n_k, n_i)
        sum1 = (psi1 * keep1[..., None]).sum(2)
        y_k = y[:, :, :, None, None, :]  # (B, h, n_k, 1, 1, k)
        y_i = y[:, :, None, :, None, :]  # (B, h, 1, n_i, 1, k)
        y_j = y[:, :, None, None, :, :]  # (B, h, 1, 1, n_j, k)
        psi2 = self.psi2(y_k, y_i, y_j)  # (B, h, n_k, n_i, n_j, p)
        not_ij = ~(eye[:, :, None] | eye[:, None, :])  # (n_k, n_i, n_j)
        keep2 = real_k[..., None] * not_ij.to(y.dtype)  # (B, 1, n_k, n_i, n_j)
        return sum1, (psi2 * keep2[..., None]).sum(2)

    def _mlp_sums(self, y: torch.Tensor, real: torch.Tensor):
        """The sums of :meth:`_sums` for one-hidden-layer ψ (:class:`HeadwiseMLP`), factored.

        ψ(y_k, y_i, y_j) = σ(a_k + b_i + c_j) W₂ + b₂ with a, b, c the first layer's per-token
        terms (bias in a). The readout is affine, so Σ_k ψ = (Σ_k σ(·)) W₂ + (count) b₂, and
        the sum over k ∉ {i, j} is the sum over all real k less the k = i and k = j terms.
        The hidden sum over k is :class:`PairPooledActivation`, formed one query at a time;
        no (n, n, n, ·) tensor is held. Entries with i = j are formed but unused.
        """
        bsz, heads, n, _ = y.shape
        act1, act2 = self.psi1.activation, self.psi2.activation
        rows = real[:, None, None, :]  # (B, 1, 1, n_k): a row vector to contract k
        r_i, r_j = real[:, None, :, None], real[:, None, None, :]  # (B, 1, n, 1), (B, 1, 1, n)
        # ψ₁: hidden (B, h, n_k, n_i, H)
        a, b = self.psi1.project(y, y)
        a = a + self.psi1.bias[:, None, :]
        width = a.shape[-1]
        act = act1(a[:, :, :, None] + b[:, :, None]).reshape(bsz, heads, n, -1)  # (B,h,n_k,n_i·H)
        all_k = torch.matmul(rows, act)
        own = act1(a + b)  # (B, h, n_i, H): the k = i term
        hidden1 = all_k.reshape(bsz, heads, n, width) - r_i * own
        sum1 = self.psi1.readout(hidden1, real.sum(1)[:, None, None] - r_i[..., 0])
        # ψ₂: hidden (B, h, n_k, n_i, n_j, H)
        a, b, c = self.psi2.project(y, y, y)
        a = a + self.psi2.bias[:, None, :]
        all_k = pair_pooled_activation(a, b, c, real, act2)  # (B, h, n_i, n_j, H)
        at_i = act2((a + b)[:, :, :, None] + c[:, :, None, :])  # (B, h, n_i, n_j, H): k = i
        at_j = act2(b[:, :, :, None] + (a + c)[:, :, None, :])  # k = j
        hidden2 = all_k - r_i[..., None] * at_i - r_j[..., None] * at_j
        count2 = real.sum(1)[:, None, None, None] - r_i - r_j  # (B, 1, n_i, n_j)
        return sum1, self.psi2.readout(hidden2, count2)


# --------------------------------------------------------------------------------------------
# The shared core: f(X, Z) = Σ_i W_i X̃ g_i  (Eqs. 3.1, 5.1, 5.3)
# --------------------------------------------------------------------------------------------


@dataclass
class KeyRows:
    """Listed (query, key) pairs: r query rows per sequence with m key slots each.

    ``query`` (B, r) int64: the token of each row; ``keys`` (B, r, m) int64: its keys;
    ``valid`` (B, r, m) bool: False at unused slots (a row without a valid slot contributes
    nothing); ``buckets`` (B, r, m) int64 relative buckets, or None. Attention over listed
    pairs equals the dense attention whose mask holds exactly these pairs, at each listed query,
    without the (n, n) tensors (windowed attention: m does not grow with n). Functions of the
    tokens only: invariant, the laws of :class:`KnowledgeAttention` are unchanged.
    """

    query: torch.Tensor
    keys: torch.Tensor
    valid: torch.Tensor
    buckets: torch.Tensor | None = None


def _gather_tokens(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t (B, h, n, c) at token positions index (B, *s) -> (B, h, *s, c)."""
    bsz, heads, _, c = t.shape
    flat = index.reshape(bsz, 1, -1, 1).expand(-1, heads, -1, c)  # (B, h, Π s, c)
    return t.gather(2, flat).reshape(bsz, heads, *index.shape[1:], c)


class KnowledgeAttention(nn.Module):
    """Multi-head knowledge attention Σ_i W_i X g_i(Z_iᵀX) (Ma & Ying Eqs. 5.1, 5.3, Prop. 3.2).

    Shapes (B batch, n tokens, d embedding, m external knowledge vectors; rows layout):
    ``forward(x, mask=None, knowledge=None, buckets=None)``: ``x`` ``(B, n, d) -> (B, n, d)``;
    ``mask`` ``(B, n)`` or ``(B, n, n)`` bool, ``knowledge`` ``(B, m, d)``, ``buckets``
    ``(B, n, n)`` int64. Parameters (h heads, k learned knowledge, v value width): ``z``
    ``(h, d, k)``, ``w_value`` ``(h, v, d)``, ``w_out`` ``(h, d, v)``.

    Options (keyword-only): ``d_model`` d, ``heads`` h, ``knowledge`` k >= 0 and
    ``value_dim`` v (integers; k + ``external`` >= 1); ``coefficients``: the g, e.g.
    ``Coefficients(QuadraticScore(...), SoftmaxNormalizer())`` for softmax attention;
    ``external`` m (default 0); ``init_scale`` of Z (default 1.0); ``relative``: buckets
    of a learned score term (default 0: none).

    One core for every form: ``coefficients`` is the g (a :class:`Coefficients`,
    :class:`GeneralCoefficients` or :class:`PermutationCoefficients`). W_i = W_out,i W_V,i
    (d×v)(v×d) is the per-head change of embedding (5.1). Knowledge per head is
    Z_i = [learned (d×k), external (d×m)]: ``knowledge`` learned columns (may be 0) and,
    when ``external > 0``, the m vectors passed to ``forward`` as ``knowledge`` (B, m, d) rows
    (e.g. another sequence's representation), shared by all heads. With the general
    coefficients the knowledge vectors are also values (the Z g₂ term of Eq. 3.1).

    Law: f(QX, QZ; QWQᵀ) = Q f(X, Z; W) for every orthogonal Q (Def. 3.2), where Z includes
    the external knowledge; f(XP, Z) = f(X, Z)P for permutations P of the tokens (Def. 4.1).

    ``relative > 0`` adds a learned score term b_h[u_ji] per head (h, relative) for bucket
    indices u (B, n, n) passed to ``forward``: a function of the tokens' position indices,
    not of X, so it is invariant and the law above holds unchanged (the normalised forms
    only: :class:`Coefficients`).
    """

    embedding_axes = {"z": (1,), "w_value": (2,), "w_out": (1,), "relative_bias": ()}

    def __init__(
        self,
        *,
        d_model: int,
        heads: int,
        knowledge: int,
        value_dim: int,
        coefficients: nn.Module,
        external: int = 0,
        init_scale: float = 1.0,
        relative: int = 0,
    ) -> None:
        super().__init__()
        if knowledge + external < 1:
            raise ValueError("need at least one knowledge vector per head (knowledge + external)")
        if relative and not isinstance(coefficients, Coefficients):
            raise ValueError(
                f"a relative score term needs a score-and-normaliser g; "
                f"{type(coefficients).__name__} has no single score to add it to"
            )
        self.relative_bias = nn.Parameter(torch.zeros(heads, relative)) if relative else None
        self.heads, self.knowledge, self.external = heads, knowledge, external
        self.z = nn.Parameter(
            torch.randn(heads, d_model, knowledge) * init_scale / math.sqrt(d_model)
        )
        self.w_value = nn.Parameter(torch.randn(heads, value_dim, d_model) / math.sqrt(d_model))
        self.w_out = nn.Parameter(
            torch.randn(heads, d_model, value_dim) / math.sqrt(value_dim * heads)
        )
        self.coefficients = coefficients

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        knowledge: torch.Tensor | None = None,
        buckets: torch.Tensor | None = None,
        rows: Sequence[KeyRows] | None = None,
    ) -> torch.Tensor:
        """``x`` (B, n, d) rows; ``mask`` (B, n) True at real tokens, or (B, n, n) True where
        query j reads key i (causal decoding); ``knowledge`` (B, m, d); ``buckets`` (B, n, n)
        int64 in [0, relative): the relative term's bucket of each (query j, key i).
        ``rows``: listed pairs instead of ``mask`` and ``buckets`` (:class:`KeyRows`; the
        score-and-normaliser g without external knowledge); a query in no row gets 0."""
        if rows is not None:
            return self._listed(x, rows)
        bsz, n, _ = x.shape
        if mask is None:
            mask = torch.ones(bsz, n, dtype=torch.bool, device=x.device)
        z = self.z[None].expand(bsz, -1, -1, -1)  # (B, h, d, k)
        if self.external:
            if knowledge is None or knowledge.shape[1] != self.external:
                got = None if knowledge is None else tuple(knowledge.shape)
                raise ValueError(
                    f"this layer was built for external knowledge of {self.external} vectors "
                    f"(B, {self.external}, d); got {got}"
                )
            ext = knowledge.transpose(1, 2)[:, None].expand(-1, self.heads, -1, -1)  # (B,h,d,m)
            z = torch.cat([z, ext], dim=-1)  # (B, h, d, k+m)
        elif knowledge is not None:
            raise ValueError("this layer takes no external knowledge (built with external=0)")
        zx = torch.einsum("bnd,bhdk->bhnk", x, z)  # (B, h, n, k): (Z_iᵀ X)ᵀ
        coef = self.coefficients
        if coef.uses_gram:
            xx = torch.einsum("bjd,bid->bji", x, x)  # (B, n, n): XᵀX
            zz = torch.einsum("bhdk,bhdl->bhkl", z, z)  # (B, h, k, k): ZᵀZ
            inv = Invariants(zx, mask, xx=xx, zz=zz)
        else:
            inv = Invariants(zx, mask)
        if self.relative_bias is not None:
            if buckets is None:
                raise ValueError("this layer was built with a relative term: pass its buckets")
            inv.bias = self.relative_bias[:, buckets].transpose(0, 1)  # (B, h, n, n)
        a = coef(inv)  # (B, h, n, keys): keys = n, or n + k with knowledge values
        values = x[:, None].expand(-1, self.heads, -1, -1)  # (B, h, n, d): columns of X
        if coef.knowledge_keys:
            values = torch.cat([values, z.transpose(-1, -2)], dim=2)  # (B, h, n+k, d): X̃
        values = torch.einsum("bhud,hvd->bhuv", values, self.w_value)  # (B, h, keys, v)
        mixed = torch.einsum("bhju,bhuv->bhjv", a, values)  # (B, h, n, v): (W_V X̃ g)ᵀ
        return torch.einsum("bhjv,hdv->bjd", mixed, self.w_out)  # (B, n, d): Σ_i W_i X̃ g_i

    def _listed(self, x: torch.Tensor, rows: Sequence[KeyRows], chunk: int = 256) -> torch.Tensor:
        """:meth:`forward` over listed pairs, ``chunk`` query rows at a time (bounded memory)."""
        self._check_listed()
        zx = torch.einsum("bnd,hdk->bhnk", x, self.z)  # (B, h, n, k): (Z_iᵀ X)ᵀ
        values = torch.einsum("bnd,hvd->bhnv", x, self.w_value)  # (B, h, n, v)
        out = torch.zeros_like(x)  # (B, n, d)
        for part in rows:
            for lo in range(0, part.query.shape[1], chunk):
                query = part.query[:, lo : lo + chunk]  # (B, r)
                keys = part.keys[:, lo : lo + chunk]  # (B, r, m)
                buckets = None if part.buckets is None else part.buckets[:, lo : lo + chunk]
                part_out = self._mix(
                    _gather_tokens(zx, query),
                    _gather_tokens(zx, keys),
                    _gather_tokens(values, keys),
                    part.valid[:, lo : lo + chunk],
                    buckets,
                )  # (B, r, d)
                out = out.scatter_add(1, query[..., None].expand_as(part_out), part_out)
        return out  # (B, n, d)

    def at_rows(
        self, xq: torch.Tensor, xk: torch.Tensor, valid: torch.Tensor, buckets=None
    ) -> torch.Tensor:
        """The output at r query rows from their own keys (incremental decoding): queries
        ``xq`` (B, r, d), keys ``xk`` (B, r, m, d), ``valid`` and ``buckets`` (B, r, m) as in
        :class:`KeyRows` -> (B, r, d), the rows :meth:`forward` gives over the same pairs."""
        self._check_listed()
        yq = torch.einsum("brd,hdk->bhrk", xq, self.z)  # (B, h, r, k)
        yk = torch.einsum("brmd,hdk->bhrmk", xk, self.z)  # (B, h, r, m, k)
        vk = torch.einsum("brmd,hvd->bhrmv", xk, self.w_value)  # (B, h, r, m, v)
        return self._mix(yq, yk, vk, valid, buckets)

    def _check_listed(self) -> None:
        coef = self.coefficients
        if self.external or not isinstance(coef, Coefficients) or coef.knowledge_keys:
            raise ValueError(
                "listed key rows need the score-and-normaliser g and no external knowledge"
            )

    def _mix(self, yq, yk, vk, valid, buckets) -> torch.Tensor:
        """Queries yq (B, h, r, k), keys yk (B, h, r, m, k), values vk (B, h, r, m, v) ->
        (B, r, d): Σ_i W_i X g_i over each row's valid keys."""
        scores = self.coefficients.score.pairs(yq, yk)  # (B, h, r, m)
        if self.relative_bias is not None:
            if buckets is None:
                raise ValueError("this layer was built with a relative term: pass its buckets")
            scores = scores + self.relative_bias[:, buckets].transpose(0, 1)  # (B, h, r, m)
        some = valid | ~valid.any(-1, keepdim=True)  # (B, r, m): empty rows stay finite
        a = self.coefficients.normalizer(scores, some) * valid[:, None]  # (B, h, r, m)
        mixed = torch.einsum("bhrm,bhrmv->bhrv", a, vk)  # (B, h, r, v)
        return torch.einsum("bhrv,hdv->brd", mixed, self.w_out)  # (B, r, d)


# --------------------------------------------------------------------------------------------
# Blocks: rotation-equivariant norm, position-wise MLP, residual stack
# --------------------------------------------------------------------------------------------


class ScalarRMSNorm(nn.Module):
    """x / rms(x) · γ with one scalar γ: rotation equivariant, N(xQᵀ) = N(x)Qᵀ.

    Shapes (B batch, n tokens, d embedding): ``(B, n, d) -> (B, n, d)``, rms over d.
    LayerNorm is not equivariant: its per-coordinate mean and gains single out the basis.
    Options: ``eps`` added to the mean square (default 1e-6).
    """

    embedding_axes = {"gain": ()}

    def __init__(self, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = x.pow(2).mean(-1, keepdim=True).add(self.eps).sqrt()  # (B, n, 1)
        return x / rms * self.gain


class PositionwiseMLP(nn.Module):
    """V σ(U x + b) + c on each token (Ma & Ying Eq. 5.2); law: (QV, UQᵀ, b, Qc).

    Shapes (B batch, n tokens, d embedding, H hidden): ``(B, n, d) -> (B, n, d)``.
    U (H, d) has its embedding index on axis 1, V (d, H) and c (d,) on axis 0, so with
    those moved by Q the map satisfies f(x Qᵀ) = f(x) Qᵀ for every orthogonal Q.
    Options (keyword-only): ``d_model`` d, ``hidden`` H, ``activation`` σ (a callable).
    """

    embedding_axes = {"u": (1,), "b": (), "v": (0,), "c": (0,)}

    def __init__(self, *, d_model: int, hidden: int, activation: Activation) -> None:
        super().__init__()
        self.u = nn.Parameter(torch.randn(hidden, d_model) / math.sqrt(d_model))
        self.b = nn.Parameter(torch.zeros(hidden))
        self.v = nn.Parameter(torch.randn(d_model, hidden) / math.sqrt(hidden))
        self.c = nn.Parameter(torch.zeros(d_model))
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.activation(torch.einsum("bnd,Hd->bnH", x, self.u) + self.b)  # (B, n, H)
        return torch.einsum("bnH,dH->bnd", hidden, self.v) + self.c  # (B, n, d)


class KnowledgeBlock(nn.Module):
    """h ← h + A(N(h)); h ← h + M(N(h)): one stacked layer of Sec. 5 with residual links.

    Shapes (B batch, n tokens, d embedding, m external knowledge vectors):
    ``forward(x, mask=None, knowledge=None, buckets=None, rows=None)``:
    ``(B, n, d) -> (B, n, d)``, the other arguments as :meth:`KnowledgeAttention.forward`.

    Law: equivariant with knowledge, ``rotate_embedding(block, Q)(x Qᵀ) = block(x) Qᵀ`` for
    every orthogonal Q, and permutation equivariant in the tokens, because each part is.

    Options (keyword-only): ``attention`` A, a :class:`KnowledgeAttention`; ``mlp`` M, a
    :class:`PositionwiseMLP` or None; ``norm`` N, a factory of the norm (default
    :class:`ScalarRMSNorm`; None for none); ``residual`` (default True; False: h ← A(N(h))).
    """

    embedding_axes: dict[str, tuple[int, ...]] = {}

    def __init__(
        self,
        *,
        attention: KnowledgeAttention,
        mlp: PositionwiseMLP | None,
        norm: Callable[[], nn.Module] | None = ScalarRMSNorm,
        residual: bool = True,
    ) -> None:
        super().__init__()
        self.attention = attention
        self.mlp = mlp
        self.norm1 = norm() if norm is not None else nn.Identity()
        self.norm2 = norm() if (norm is not None and mlp is not None) else nn.Identity()
        self.residual = residual

    def forward(self, x, mask=None, knowledge=None, buckets=None, rows=None):
        update = self.attention(self.norm1(x), mask, knowledge, buckets, rows)
        return self._finish(x, update)

    def at_rows(self, x: torch.Tensor, rows: KeyRows) -> torch.Tensor:
        """The block's output (B, r, d) at the rows ``rows.query`` of ``x`` (B, n, d) only,
        from their listed keys: incremental decoding, one row per sequence at a time."""
        flat = rows.keys.flatten(1)[..., None].expand(-1, -1, x.shape[-1])  # (B, r·m, d)
        xk = x.gather(1, flat).view(*rows.keys.shape, x.shape[-1])  # (B, r, m, d)
        xq = x.gather(1, rows.query[..., None].expand(-1, -1, x.shape[-1]))  # (B, r, d)
        update = self.attention.at_rows(self.norm1(xq), self.norm1(xk), rows.valid, rows.buckets)
        return self._finish(xq, update)

    def _finish(self, x: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        x = x + update if self.residual else update
        if self.mlp is not None:
            update = self.mlp(self.norm2(x))
            x = x + update if self.residual else update
        return x


# --------------------------------------------------------------------------------------------
# Position encoding (Ma & Ying footnote 1): knowledge too, P → QP
# --------------------------------------------------------------------------------------------


def sinusoid_table(lengths: torch.Tensor, n: int, width: int, base: float | None) -> torch.Tensor:
    """Sinusoids S (B, n, width) in rows; zero at positions ≥ each sequence's length.

    ``base=None``: Ma & Ying footnote 1 as written, with the sequence's own length n_b as base
    and 1-based i, j: S_{j, 2i−1} = sin(j / n_b^{2i/w}), S_{j, 2i} = cos(j / n_b^{2i/w}),
    i = 1…w/2, j = 1…n_b. ``base=10000.0`` (or any number): the usual encoding of Vaswani
    et al., 0-based: S_{j, 2i} = sin(j / base^{2i/w}), S_{j, 2i+1} = cos(…), i = 0…w/2−1.
    """
    if width % 2:
        raise ValueError(f"the sinusoid width {width} must be even (sin/cos pairs)")
    device = lengths.device
    half = torch.arange(width // 2, dtype=torch.float64, device=device)  # (w/2,)
    pos = torch.arange(n, dtype=torch.float64, device=device)  # (n,)
    if base is None:
        exponent = 2 * (half + 1) / width  # 2i/w, i = 1…w/2
        log_base = lengths.to(torch.float64).clamp_min(1).log()  # (B,)
        inv_freq = torch.exp(-exponent[None, :] * log_base[:, None])  # (B, w/2)
        angle = (pos + 1)[None, :, None] * inv_freq[:, None, :]  # (B, n, w/2), j = 1…n
    else:
        exponent = 2 * half / width  # 2i/w, i = 0…w/2−1
        inv_freq = torch.exp(-exponent * math.log(base))  # (w/2,)
        angle = pos[None, :, None] * inv_freq[None, None, :]  # (1, n, w/2)
        angle = angle.expand(lengths.shape[0], -1, -1)  # (B, n, w/2)
    table = torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(-2)  # (B, n, w): sin, cos
    inside = pos[None, :] < lengths[:, None].to(torch.float64)  # (B, n)
    return table * inside[..., None]


class SinusoidPosition(nn.Module):
    """P = F S: fixed sinusoids S (footnote 1) seen through a learned frame F (d × w).

    The frame is the position encoding's embedding index, so P → QP is F → QF: the encoding
    added in the embedding space is knowledge and rotates with it. ``base=None`` uses the
    footnote's base n (each sequence its own length), a number the usual base (10000).
    """

    embedding_axes = {"frame": (0,)}

    def __init__(self, *, d_model: int, width: int, base: float | None, init_scale: float = 1.0):
        super().__init__()
        if width % 2:
            raise ValueError(f"position width {width} must be even (sin/cos pairs)")
        self.frame = nn.Parameter(torch.eye(d_model, width) * init_scale)
        self.width, self.base = width, base

    def forward(self, lengths: torch.Tensor, n: int) -> torch.Tensor:
        table = sinusoid_table(lengths, n, self.width, self.base).to(self.frame.dtype)  # (B,n,w)
        return torch.einsum("bnw,dw->bnd", table, self.frame)  # (B, n, d)


class LearnedPosition(nn.Module):
    """A learned P (max_len × d in rows): knowledge, P → QP; covers lengths ≤ max_len only."""

    embedding_axes = {"table": (1,)}

    def __init__(self, *, d_model: int, max_len: int, init_scale: float = 1.0):
        super().__init__()
        self.table = nn.Parameter(torch.randn(max_len, d_model) * init_scale / math.sqrt(d_model))

    def forward(self, lengths: torch.Tensor, n: int) -> torch.Tensor:
        if n > self.table.shape[0]:
            raise ValueError(
                f"sequence length {n} exceeds the learned positions ({self.table.shape[0]}); "
                "use a sinusoid position encoding for longer sequences"
            )
        pos = torch.arange(n, device=lengths.device)  # (n,)
        inside = (pos[None, :] < lengths[:, None]).to(self.table.dtype)  # (B, n)
        return self.table[:n][None] * inside[..., None]  # (B, n, d)


def index_sinusoids(index: torch.Tensor, width: int, base: float) -> torch.Tensor:
    """S (B, n, width): S_{t, 2i} = sin(c_t / base^{2i/w}), S_{t, 2i+1} = cos(…) of a per-token
    index c_t ≥ 1 (``index`` (B, n) int); rows with c_t = 0 (no position) are zero."""
    if width % 2:
        raise ValueError(f"the sinusoid width {width} must be even (sin/cos pairs)")
    half = torch.arange(width // 2, dtype=torch.float64, device=index.device)  # (w/2,)
    inv_freq = torch.exp(-(2 * half / width) * math.log(base))  # (w/2,)
    angle = index.to(torch.float64)[..., None] * inv_freq  # (B, n, w/2)
    table = torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(-2)  # (B, n, w)
    return table * (index > 0)[..., None]


class IndexSinusoidPosition(nn.Module):
    """p_t = F s(c_t): sinusoids of a per-token index c_t (e.g. a coupled position) seen through
    a learned frame F (d × w); p_t = 0 where c_t = 0. Defined at every index.

    Law: knowledge, P → QP is F → QF (the index is a function of the tokens, not of X).
    """

    embedding_axes = {"frame": (0,)}

    def __init__(self, *, d_model: int, width: int, base: float, init_scale: float = 1.0):
        super().__init__()
        if width % 2:
            raise ValueError(f"position width {width} must be even (sin/cos pairs)")
        self.frame = nn.Parameter(torch.eye(d_model, width) * init_scale)
        self.width, self.base = width, base

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        table = index_sinusoids(index, self.width, self.base).to(self.frame.dtype)  # (B, n, w)
        return torch.einsum("bnw,dw->bnd", table, self.frame)  # (B, n, d)


class IndexTablePosition(nn.Module):
    """p_t = F T[c_t]: a learned table T (rows × w) of per-token indices c_t (Abacus-style,
    McLeish et al. 2024) seen through a learned frame F (d × w); p_t = 0 where c_t = 0.

    Law: knowledge, P → QP is F → QF; T holds coordinates in the frame (invariant). Covers
    indices < rows only.
    """

    embedding_axes = {"frame": (0,), "table": ()}

    def __init__(self, *, d_model: int, width: int, rows: int, init_scale: float = 1.0):
        super().__init__()
        self.frame = nn.Parameter(torch.eye(d_model, width) * init_scale)
        self.table = nn.Parameter(torch.randn(rows, width))  # entries of E's size

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        rows = self.table.shape[0]
        if int(index.max()) >= rows:
            raise ValueError(
                f"position index {int(index.max())} exceeds the table's {rows} rows; build the "
                "model for the longest data (its max_len) or lower model.position_offset"
            )
        table = self.table[index] * (index > 0)[..., None].to(self.table.dtype)  # (B, n, w)
        return torch.einsum("bnw,dw->bnd", table, self.frame)  # (B, n, d)
