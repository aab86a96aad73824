"""The attention core of lifting / group self-attention: a two-level softmax.

Letters: Z = batch * heads, L query points, Lkv key points, G query group elements, M key group
elements, V output group elements, J neighbours per query (P*P when local, all points when
global), d channels per head, e spatial-encoding channels (the first e of d), D distinct
spatial offsets (J when local), K rows of the outer softmax (V in the sum form with a spatial
term, else 1).

For output (i, v), query element g and key (j, m) the logit is (GSA-Nets Eq. 16, q pre-scaled
by 1/sqrt(d))

    c[j, m, g] + s[v, j, g],   c = q_ig . k_jm + gl[m, g],     gl = q_ig . rho_H(g^-1 m)
                               s = q_ig . rho_xy(v^-1 (x_j - x_i))

and the softmax runs jointly over (j, m). Because s does not depend on m, it factorises into
two ordinary softmaxes:

    softmax_(j,m)(c + s) = pi[j, m, g] * beta[v, j, g]
    pi   = softmax_m(c[j, :, g])                     inner: over the key's group axis
    lse  = logsumexp_m(c[j, :, g])
    beta = softmax_j(s[v, :, g] + lse[:, g])         outer: over neighbours

so out(i, v) = sum_(j, g) beta[v, j, g] W[j, g] with W[j, g] = sum_m pi[j, m, g] val[j, m].
The reference's (V, G, J, M) logits per query never exist. The "single" form has one query
per output element (g = v): out(i, g) = sum_j beta[j, g] W[j, g], with s[j, g] taken at v = g.
Lifting is the sum form with G = M = 1 (pi = 1). Neighbours outside the image (``valid``
false) get beta = 0. The spatial encoding is a table ``rho (V, D, e)`` over distinct offsets,
indexed per (query, neighbour) by ``offsets (L, J)`` (None when local: D = J, the same for
every query).

Attention dropout zeroes entries of pi (shared by every v) by a keep mask that is a hash of
(seed, z, i, j, m, g) (:func:`keep_mask`): every backend draws the same mask, in any order,
and the backward redraws it instead of storing it.

Backends, chosen by :func:`factorised_attention` (``backend="auto"``):
  ``"cpp"``    the fused CPU kernel (``gsa_kernel.cpp``): per query, logits, both softmaxes
               and the value sums in cache; a hand-written backward that recomputes them.
  ``"triton"`` the fused GPU kernel (``gsa_triton_kernel.py``): one program per query, the
               same equations as the CPU kernel, its backward recomputing them; CUDA tensors
               (CPU tensors only in Triton's interpreter, ``TRITON_INTERPRET=1``, for tests).
  ``"torch"``  this file's plain PyTorch version of the same algorithm over chunks of queries,
               each recomputed in the backward (activation checkpointing): any device.
:func:`dense_attention` is the reference algorithm (full logits, autograd), the test oracle
and the path of the reference's v-dependent group index (a negative control).
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

FORMS = ("sum", "single")
BACKENDS = ("auto", "cpp", "triton", "torch")
DROP_STEPS = 1 << 15  # dropout rates are multiples of 2^-15

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for int64 ``x`` in [0, 2^32), without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (the "lowbias32" constants) on int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def keep_mask(seed: int, shape: tuple[int, ...], rows: slice, drop: float, device) -> torch.Tensor:
    """The keep mask ``(Z, Lc, J, M, G)`` (bool) of queries ``rows`` of a call whose mask has
    ``shape`` = (Z, L, J, M, G): entry x at flat index n of the full mask is kept iff
    ``hash32(hash32(n mod 2^32 xor s0) xor s1 xor (n >> 32)) mod 2^15 >= drop * 2^15``, with
    (s0, s1) the low and high 32 bits of ``seed``. The kernels compute the same function."""
    z, n_q, j, m, g = shape
    per_query = j * m * g
    local = torch.arange(per_query, device=device)  # (JMG,)
    zi = torch.arange(z, device=device)[:, None] * n_q
    qi = torch.arange(rows.start, rows.stop, device=device)[None, :]
    flat = ((zi + qi) * per_query)[..., None] + local  # (Z, Lc, JMG)
    s0, s1 = seed & _MASK32, (seed >> 32) & _MASK32
    x = _hash32((flat & _MASK32) ^ s0)
    x = _hash32(x ^ s1 ^ (flat >> 32))
    keep = (x & (DROP_STEPS - 1)) >= round(drop * DROP_STEPS)
    return keep.view(z, rows.stop - rows.start, j, m, g)


def group_logits(q: torch.Tensor, group_rho: torch.Tensor | None) -> torch.Tensor | None:
    """gl = q_ig . rho_H(g^-1 m) over q's last c channels: ``(Z, L, M, G)`` from q
    ``(Z, L, G, d)`` and group_rho ``(G, M, c)``."""
    if group_rho is None:
        return None
    c = group_rho.shape[-1]
    return torch.einsum("zlgc,gmc->zlmg", q[..., q.shape[-1] - c :], group_rho).contiguous()


def _spatial_table(rho: torch.Tensor, offsets: torch.Tensor | None, rows: slice, j: int):
    """rho_xy at each (query, neighbour) of ``rows``: ``(V, Lc, J, e)``, or ``(V, 1, J, e)``
    when local (the same for every query)."""
    if offsets is None:
        return rho[:, None, :j]  # (V, 1, J, e)
    return rho[:, offsets[rows]]  # (V, Lc, J, e)


def _torch_chunk(q, k, v, gl, rho, offsets, neighbour, valid, keep, rows, form, n):
    """The factorised algorithm for queries ``rows``, in plain PyTorch: ``(Z, Lc, V, d)``."""
    z, lc, g, d = q.shape
    j = neighbour.shape[1]
    nb = neighbour[rows]  # (Lc, J)
    k_nb, v_nb = k[:, nb], v[:, nb]  # (Z, Lc, J, M, d)
    c = torch.einsum("zlgc,zljmc->zljmg", q, k_nb)  # (Z, Lc, J, M, G)
    if gl is not None:
        c = c + gl[:, :, None]
    lse = torch.logsumexp(c, dim=3)  # (Z, Lc, J, G)
    pi = torch.exp(c - lse[:, :, :, None])  # (Z, Lc, J, M, G)
    if keep is not None:
        pi = pi * keep
    w = torch.einsum("zljmg,zljmc->zljgc", pi, v_nb)  # (Z, Lc, J, G, d)
    t = lse[:, :, None]  # (Z, Lc, 1, J, G)
    if rho is not None:
        e = rho.shape[-1]
        table = _spatial_table(rho, offsets, rows, j).expand(-1, lc, -1, -1)  # (V, Lc, J, e)
        if form == "sum":
            t = t + torch.einsum("zlgc,vljc->zlvjg", q[..., :e], table)  # (Z, Lc, V, J, G)
        else:  # v = g
            t = t + torch.einsum("zlgc,gljc->zljg", q[..., :e], table)[:, :, None]
    if valid is not None:
        t = t.masked_fill(~valid[rows][None, :, None, :, None], -math.inf)
    beta = torch.softmax(t, dim=3)  # (Z, Lc, K, J, G): over neighbours
    if form == "single":
        return torch.einsum("zljg,zljgc->zlgc", beta[:, :, 0], w)  # (Z, Lc, G = V, d)
    out = torch.einsum("zlkjg,zljgc->zlkc", beta, w)  # (Z, Lc, K, d)
    return out.expand(z, lc, n, d)  # K = 1: the same for every v


def _torch_attention(
    q, k, v, gl, rho, offsets, neighbour, valid, form, n, drop, seed, chunk, recompute
):
    """The plain PyTorch backend: chunks of ``chunk`` queries, with ``recompute`` each
    recomputed in the backward (so peak memory is one chunk's tensors)."""
    z, n_q, g, _ = q.shape
    m, j = k.shape[2], neighbour.shape[1]
    recompute = (
        recompute
        and torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (q, k, v, gl, rho))
    )
    outs = []
    for lo in range(0, n_q, chunk):
        rows = slice(lo, min(lo + chunk, n_q))

        def run(q_rows, k, v, gl_rows, rho, rows=rows):
            keep = None
            if drop > 0:
                keep = keep_mask(seed, (z, n_q, j, m, g), rows, drop, q.device).to(q.dtype)
            return _torch_chunk(
                q_rows, k, v, gl_rows, rho, offsets, neighbour, valid, keep, rows, form, n
            )

        args = (q[:, rows], k, v, None if gl is None else gl[:, rows], rho)
        outs.append(checkpoint(run, *args, use_reentrant=False) if recompute else run(*args))
    return torch.cat(outs, dim=1)  # (Z, L, V, d)


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return False


def _widen(t: torch.Tensor | None) -> torch.Tensor | None:
    """float16 / bfloat16 -> float32 (what autocast hands over); anything else as it is."""
    return t.float() if t is not None and t.dtype in (torch.float16, torch.bfloat16) else t


def backend_for(device, dtype=torch.float32, backend: str = "auto") -> str:
    """The backend a call on ``device`` with ``dtype`` runs: ``backend`` itself, or for
    ``"auto"`` the Triton kernel on CUDA when Triton is installed, the fused CPU kernel where it
    applies and is built, else ``"torch"``."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}; choose one of {BACKENDS}")
    if backend != "auto":
        return backend
    from symattn_cli.nn import gsa_native, gsa_triton

    device = torch.device(device)
    if device.type == "cuda" and gsa_triton.available():
        return "triton"
    if device.type == "cpu" and dtype in (torch.float32, torch.float64) and gsa_native.load():
        return "cpp"
    return "torch"


def factorised_attention(
    q, k, v, group_rho, rho, offsets, neighbour, valid, *, form: str, n: int,
    drop: float = 0.0, chunk: int = 64, recompute: bool = True, backend: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """``out (Z, L, V, d)`` from q ``(Z, L, G, d)`` (pre-scaled by 1/sqrt(d)), k, v
    ``(Z, Lkv, M, d)``.

    ``group_rho`` ``(G, M, c)`` or None: rho_H(g^-1 m), dotted with q's last c channels;
    ``rho`` ``(V, D, e)`` or None: rho_xy, dotted with q's first e channels, at offset
    ``offsets[i, j]`` ``(L, J)`` (None: local, offset j); ``neighbour`` ``(L, J)`` indices
    into Lkv; ``valid`` ``(L, J)`` bool or None; ``n`` = V; ``drop`` the attention-dropout
    rate (a multiple of 2^-15 after rounding; the output is rescaled by 1 / (1 - drop));
    ``chunk`` queries per chunk of the torch backend, and ``recompute`` whether it recomputes
    them in the backward (the fused kernels always do); ``backend`` one of :data:`BACKENDS`.

    Under autocast (mixed precision) the core runs in float32, forward and backward. The output
    is float32; the maps around it keep autocast.
    """
    if form not in FORMS:
        raise ValueError(f"form={form!r}; choose one of {FORMS}")
    if not 0.0 <= drop < 1.0:
        raise ValueError(f"attention dropout {drop} must be in [0, 1)")
    if _autocast_on(q.device.type):  # mixed precision: the core runs in float32
        with torch.autocast(q.device.type, enabled=False):
            q, k, v, group_rho, rho = (_widen(t) for t in (q, k, v, group_rho, rho))
            return factorised_attention(
                q, k, v, group_rho, rho, offsets, neighbour, valid, form=form, n=n, drop=drop,
                chunk=chunk, recompute=recompute, backend=backend,
            )  # fmt: skip
    drop = round(drop * DROP_STEPS) / DROP_STEPS
    # One seed per call, drawn from torch's generator: torch.manual_seed fixes the masks.
    seed = int(torch.randint(1 << 62, (), device="cpu")) if drop > 0 else 0
    gl = group_logits(q, group_rho)  # (Z, L, M, G) or None
    which = backend_for(q.device, q.dtype, backend)
    if which == "cpp":
        from symattn_cli.nn.gsa_native import fused_attention

        out = fused_attention(q, k, v, gl, rho, offsets, neighbour, valid, form, n, drop, seed)
    elif which == "triton":
        from symattn_cli.nn.gsa_triton import triton_attention

        out = triton_attention(q, k, v, gl, rho, offsets, neighbour, valid, form, n, drop, seed)
    else:
        out = _torch_attention(
            q, k, v, gl, rho, offsets, neighbour, valid, form, n, drop, seed, max(int(chunk), 1),
            recompute,
        )  # fmt: skip
    return out * (1.0 / (1.0 - drop)) if drop > 0 else out


def dense_weights(q, k, group_rho, rho, offsets, neighbour, valid, *, form: str, n: int,
                  rows: slice) -> torch.Tensor:  # fmt: skip
    """The reference algorithm's attention probabilities ``(P, V, G, J, M)`` (P = Z * Lc; G = 1
    in the single form, where g = v) for the queries q ``(Z, Lc, G, d)`` (scaled) at ``rows``
    of the layer's L: keys k ``(Z, Lkv, M, d)``, the layer's ``neighbour`` indices and
    ``valid`` ``(L, J)`` (or None); ``group_rho`` ``(G, M, E)`` or, v-dependent,
    ``(V, G, M, E)`` on q's last E channels; ``rho`` ``(V, D, e)`` on the first e, at
    ``offsets`` ``(L, J)`` (None: local). Full logits, plain autograd."""
    z, lc, g, d = q.shape
    m, j = k.shape[2], neighbour.shape[1]
    p = z * lc
    k_nb = k[:, neighbour[rows]].view(p, j, m, d)  # (P, J, M, d)
    q2 = q.reshape(p, g, d)  # (P, G, d)
    full = torch.einsum("pgc,pjmc->pgjm", q2, k_nb)[:, None]  # (P, 1, G, J, M)
    if group_rho is not None:
        table = group_rho if group_rho.dim() == 4 else group_rho[None]  # (V or 1, G, M, E)
        gt = torch.einsum("pgc,vgmc->pvgm", q2[..., d - table.shape[-1] :], table)
        full = full + gt[:, :, :, None, :]  # (P, V or 1, G, J, M)
    if rho is not None:
        e = rho.shape[-1]
        table = _spatial_table(rho, offsets, rows, j).expand(-1, lc, -1, -1)  # (V, Lc, J, e)
        s = torch.einsum("zlgc,vljc->zlvgj", q[..., :e], table).reshape(p, -1, g, j)
        full = full + s[..., None]  # (P, V, G, J, M)
    full = full.expand(p, n, g, j, m)
    if form == "single":  # g = v only
        full = torch.diagonal(full, dim1=1, dim2=2).permute(0, 3, 1, 2)[:, :, None]
    if valid is not None:
        mask = valid[rows].repeat(z, 1)[:, None, None, :, None]  # (P, 1, 1, J, 1)
        full = full.masked_fill(~mask, -math.inf)
    return torch.softmax(full.flatten(3), dim=-1).view_as(full)  # (P, V, G, J, M)


def dense_attention(q, k, v, group_rho, rho, offsets, neighbour, valid, *, form: str, n: int,
                    drop: float = 0.0, seed: int = 0, chunk: int = 64) -> torch.Tensor:  # fmt: skip
    """The reference algorithm: full ``(P, V, G, J, M)`` logits (:func:`dense_weights`), plain
    autograd, over chunks of ``chunk`` queries; ``(Z, L, V, d)``.

    Same arguments as :func:`factorised_attention` except ``group_rho`` may be
    ``(V, G, M, E)``, a group encoding that depends on v (the reference's (m - g + v) index).
    Attention dropout multiplies the weights by :func:`keep_mask` of ``seed`` (the kernels'
    mask) and by 1 / (1 - drop). Memory grows as N^3 P^2 per query, as in the reference.
    """
    z, n_q, g, d = q.shape
    m, j = k.shape[2], neighbour.shape[1]
    drop = round(drop * DROP_STEPS) / DROP_STEPS
    outs = []
    for lo in range(0, n_q, chunk):
        rows = slice(lo, min(lo + chunk, n_q))
        lc = rows.stop - rows.start
        attn = dense_weights(
            q[:, rows], k, group_rho, rho, offsets, neighbour, valid, form=form, n=n, rows=rows
        )  # (P, V, G, J, M)
        if drop > 0:
            keep = keep_mask(seed, (z, n_q, j, m, g), rows, drop, q.device)  # (Z, Lc, J, M, G)
            keep = keep.permute(0, 1, 4, 2, 3)  # (Z, Lc, G, J, M)
            # as attn: (P, 1, G, J, M), or (P, V = G, 1, J, M) in the single form
            keep = keep.reshape(z * lc, *((g, 1) if form == "single" else (1, g)), j, m)
            attn = attn * keep.to(attn.dtype) / (1.0 - drop)
        v_nb = v[:, neighbour[rows]].view(z * lc, j, m, d)  # (P, J, M, d)
        outs.append(torch.einsum("pvgjm,pjmc->pvc", attn, v_nb).view(z, lc, n, d))
    return torch.cat(outs, dim=1)  # (Z, L, V, d)
