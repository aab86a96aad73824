"""The fused Triton kernel of the factorised attention core: the equations of the CPU kernel
(``cpp_kernel.cpp``; :mod:`symattn_cli.nn.gsa.core` states the algorithm and the letters), one
program per query; :mod:`symattn_cli.nn.gsa.triton` launches it.

Per query i of batch-head z, neighbours are visited in blocks of BJ, all of their M key
elements at once; block sizes are powers of two (B*) and loads are masked. The outer logits
t[k, j, g] have T rows k (K in the sum form; 1 in the single form, where row 0 holds t at
v = g). No tensor has more than three axes, (BJ, BM, BG) or (BT, BJ, BG), so that a block lives
in registers, and channels are taken one at a time (loops over d and e): with pik = pi keep,
W[j, g, c] = sum_m pik v[j, m, c] and out[k, c] = sum_(j, g) beta[k, j, g] W[j, g, c] (single:
out[g, c] = sum_j beta[0, j, g] W[j, g, c]). Every pass over the blocks recomputes their logits:

  forward   1. outer statistics: max and sum of exp over j of t, per (k, g), written out as
               their log-sum-exp lse_t (Z, L, T, G) for the backward
            2. out, one channel at a time
  backward  1. (the statistics: lse_t, read back; beta = exp(t - lse_t))
            2. A[k, g] = sum_j beta dbeta, dbeta[k, j, g] = sum_c go[k, c] W[j, g, c] (single:
               go[g, c]); the outer softmax's backward needs A before any j
            3. dW[j, g, c] = sum_k beta go[k, c]; dv = sum_g pik dW; dpi = keep sum_c v dW;
               dt = beta (dbeta - A), dlse = sum_k dt; dc = pi (dpi - sum_m pi dpi + dlse);
               then dq, dgl (this query's, in registers) and dk, dv, drho (shared by queries:
               atomic adds; drho into one of several copies, summed by the caller).

With a group term that depends on the output element (GL_V, sum form only: gl ``(Z, L, V, M,
G)``), pi and lse depend on v too, and T = V. Then a block's dot products q . k are computed
once and the inner softmax once per v (a loop over v), and the probabilities are contracted
over g before the values, P[v, j, m] = sum_g beta[v, j, g] pik_v[j, m, g] ``(BT, BJ, BM)``, so
that the value work does not grow with V: out[v, c] = sum_(j, m) P[v, j, m] v[j, m, c]. Its
backward, with dP[v, j, m] = sum_c go[v, c] v[j, m, c]: dv = sum_v P go[v]; dbeta_v = sum_m
pik_v dP_v, dt_v = beta_v (dbeta_v - A_v); dpi_v = keep beta_v dP_v; dc_v = pi_v (dpi_v -
sum_m pi_v dpi_v + dt_v); dgl[v] = sum_j dc_v; dq, dk from sum_v dc_v.

The atomic adds make dk, dv and drho differ from run to run on a GPU at round-off level (the
order of the additions varies); the forward and dq, dgl are deterministic. Accumulation is in
the inputs' dtype: float32 (half inputs are widened by the caller) or float64.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _keep(pid, j, J, M, G, s0, s1, threshold, BM: tl.constexpr, BG: tl.constexpr):
    """The dropout keep mask ``(BJ, BM, BG)`` of query ``pid`` = z L + i at neighbours j, as
    common.keep_mask: the flat index into (Z, L, J, M, G), its low word xor s0 mixed by the
    "lowbias32" hash, xor s1 and the high word, mixed again; kept if 15 bits >= threshold."""
    m = tl.arange(0, BM)
    g = tl.arange(0, BG)
    flat = ((pid * J + j[:, None, None]) * M + m[None, :, None]) * G + g[None, None, :]
    x = (flat & 0xFFFFFFFF).to(tl.uint32) ^ s0
    for step in tl.static_range(2):
        if step == 1:
            x = x ^ s1 ^ (flat >> 32).to(tl.uint32)
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        x = x ^ (x >> 16)
    return (x & 0x7FFF) >= threshold


@triton.jit
def _inner(c, gl_row, counts, M, G, HAS_GL: tl.constexpr, BM: tl.constexpr, BG: tl.constexpr):
    """The inner softmax over m of c = q . k ``(BJ, BM, BG)`` plus the group logits at
    ``gl_row`` ``(M, G)``: pi ``(BJ, BM, BG)`` (0 where (j, m) does not count and in the
    padding) and lse ``(BJ, BG)``."""
    m = tl.arange(0, BM)
    g = tl.arange(0, BG)
    g_ok = g < G
    if HAS_GL:
        gl = tl.load(gl_row + m[:, None] * G + g[None, :],
                     mask=(m < M)[:, None] & g_ok[None, :], other=0.0)  # (BM, BG)  # fmt: skip
        c += gl[None, :, :]
    c = tl.where((m < M)[None, :, None], c, float("-inf"))
    top = tl.max(c, axis=1)  # (BJ, BG): finite, m = 0 always counts
    p = tl.exp(c - top[:, None, :])
    total = tl.sum(p, axis=1)  # (BJ, BG)
    pi = tl.where(counts[:, :, None] & g_ok[None, None, :], p / total[:, None, :], 0.0)
    return pi, top + tl.log(total)


@triton.jit
def _row(x, k, v):
    """Row v of x ``(BT, A, B)`` along its first axis, whose indices are k: ``(A, B)``."""
    return tl.sum(tl.where(k[:, None, None] == v, x, 0.0), axis=0)


@triton.jit
def _block(
    pid, i, j0, q_row, kz, gl_row, rho_ptr, nb_ptr, off_ptr, valid_ptr, J, M, G, d, e, D, T,
    HAS_GL: tl.constexpr, GL_V: tl.constexpr, HAS_RHO: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, HAS_VALID: tl.constexpr, SINGLE: tl.constexpr,
    BJ: tl.constexpr, BM: tl.constexpr, BG: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """Neighbours j = j0 .. j0 + BJ of query i: j, the rows of k and v at their key elements
    ``(BJ, BM)`` and which count (inside the image, j < J, m < M), pi ``(BJ, BM, BG)`` (0 where
    they do not count and in the padding; with GL_V, where pi depends on v, the dot products
    q . k instead, for :func:`_inner` at each v), the outer logits t ``(BT, BJ, BG)`` (-inf
    where j does not count), and where t's spatial term reads rho: indices into rho (less the
    channel) and their mask, ``(BT, BJ, 1)`` (table row k) or in the single form ``(1, BJ,
    BG)`` (row g)."""
    j = j0 + tl.arange(0, BJ)
    m = tl.arange(0, BM)
    g = tl.arange(0, BG)
    k = tl.arange(0, BT)
    g_ok = g < G
    inside = j < J
    point = tl.load(nb_ptr + i * J + j, mask=inside, other=0)  # key points
    if HAS_OFFSETS:
        off = tl.load(off_ptr + i * J + j, mask=inside, other=0)  # rows of rho
    else:
        off = j
    if HAS_VALID:
        inside = inside & (tl.load(valid_ptr + i * J + j, mask=inside, other=0) != 0)
    rows = point[:, None] * M + m[None, :]  # (BJ, BM): rows of k and v as (Lkv M, d)
    counts = inside[:, None] & (m < M)[None, :]  # (BJ, BM)

    # inner logits c = q . k + gl, softmax over m
    qk = tl.full((BJ, BM, BG), 0.0, q_row.dtype.element_ty)
    for ch in range(d):
        kc = tl.load(kz + rows * d + ch, mask=counts, other=0.0)  # (BJ, BM)
        qc = tl.load(q_row + g * d + ch, mask=g_ok, other=0.0)  # (BG,)
        qk += kc[:, :, None] * qc[None, None, :]
    if GL_V:  # lse of row v at each v (T = V)
        t = tl.full((BT, BJ, BG), 0.0, q_row.dtype.element_ty)
        for v in range(T):
            pi_v, lse = _inner(qk, gl_row + v * M * G, counts, M, G, True, BM, BG)
            t = tl.where(k[:, None, None] == v, lse[None, :, :], t)
        pi = qk
    else:
        pi, lse = _inner(qk, gl_row, counts, M, G, HAS_GL, BM, BG)
        t = tl.full((BT, 1, 1), 0.0, q_row.dtype.element_ty) + lse[None, :, :]

    # outer logits t = lse + q[g, :e] . rho[k or g, off]
    if SINGLE:
        table = (g[None, None, :] * D + off[None, :, None]) * e
        table_ok = inside[None, :, None] & g_ok[None, None, :]
    else:
        table = (k[:, None, None] * D + off[None, :, None]) * e
        table_ok = (k < T)[:, None, None] & inside[None, :, None]
    if HAS_RHO:
        for ch in range(e):
            qc = tl.load(q_row + g * d + ch, mask=g_ok, other=0.0)
            t += tl.load(rho_ptr + table + ch, mask=table_ok, other=0.0) * qc[None, None, :]
    t = tl.where(inside[None, :, None], t, float("-inf"))
    return j, rows, counts, pi, t, table, table_ok


@triton.jit
def _statistics(
    pid, i, q_row, kz, gl_row, rho_ptr, nb_ptr, off_ptr, valid_ptr, J, M, G, d, e, D, T,
    HAS_GL: tl.constexpr, GL_V: tl.constexpr, HAS_RHO: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, HAS_VALID: tl.constexpr, SINGLE: tl.constexpr,
    BJ: tl.constexpr, BM: tl.constexpr, BG: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """Max and sum of exp over all neighbours of the outer logits, ``(BT, BG)`` each, as an
    online softmax keeps them; the max is 0 where no neighbour counts."""
    top = tl.full((BT, BG), float("-inf"), q_row.dtype.element_ty)
    total = tl.full((BT, BG), 0.0, q_row.dtype.element_ty)
    for j0 in range(0, J, BJ):
        _, _, _, _, t, _, _ = _block(
            pid, i, j0, q_row, kz, gl_row, rho_ptr, nb_ptr, off_ptr, valid_ptr, J, M, G, d, e,
            D, T, HAS_GL, GL_V, HAS_RHO, HAS_OFFSETS, HAS_VALID, SINGLE, BJ, BM, BG, BT,
        )  # fmt: skip
        new = tl.maximum(top, tl.max(t, axis=1))
        safe = tl.where(new == float("-inf"), 0.0, new)
        total = total * tl.exp(top - safe) + tl.sum(tl.exp(t - safe[:, None, :]), axis=1)
        top = new
    return tl.where(top == float("-inf"), 0.0, top), total


@triton.jit
def _mixed(qk, gl_row, counts, keep, beta, M, G, T, DROP: tl.constexpr,
           BJ: tl.constexpr, BM: tl.constexpr, BG: tl.constexpr, BT: tl.constexpr):  # fmt: skip
    """GL_V: the probabilities of a block contracted over g, P[v, j, m] = sum_g beta[v, j, g]
    pik_v[j, m, g] ``(BT, BJ, BM)``, from its dot products ``qk`` and ``beta`` ``(BT, BJ,
    BG)``."""
    k = tl.arange(0, BT)
    mixed = tl.full((BT, BJ, BM), 0.0, qk.dtype)
    for v in range(T):
        pik, lse = _inner(qk, gl_row + v * M * G, counts, M, G, True, BM, BG)
        if DROP:
            pik = tl.where(keep, pik, 0.0)
        p = tl.sum(pik * _row(beta, k, v)[:, None, :], axis=2)  # (BJ, BM)
        mixed = tl.where(k[:, None, None] == v, p[None, :, :], mixed)
    return mixed


# The seed changes with every call: no variant compiled for one that is 1 or a multiple of 16.
@triton.jit(do_not_specialize=["s0", "s1", "threshold"])
def attention_forward(
    out_ptr, lse_ptr, q_ptr, k_ptr, v_ptr, gl_ptr, rho_ptr, off_ptr, nb_ptr, valid_ptr,
    L, Lkv, J, M, G, d, e, D, V, T, s0, s1, threshold,
    HAS_GL: tl.constexpr, GL_V: tl.constexpr, HAS_RHO: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, HAS_VALID: tl.constexpr, SINGLE: tl.constexpr,
    DROP: tl.constexpr,
    BJ: tl.constexpr, BM: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
    BO: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """out ``(Z, L, V, d)`` and the outer softmax's log-sum-exp ``(Z, L, T, G)``, one query
    per program (grid: Z L). BO: output rows, BT (sum form) or BG (single form)."""
    pid = tl.program_id(0).to(tl.int64)  # z L + i
    z = pid // L
    i = pid % L
    q_row = q_ptr + pid * G * d  # (G, d)
    kz = k_ptr + z * Lkv * M * d  # (Lkv, M, d)
    vz = v_ptr + z * Lkv * M * d
    if GL_V:
        gl_row = gl_ptr + pid * V * M * G  # (V, M, G)
    else:
        gl_row = gl_ptr + pid * M * G  # (M, G)
    s0 = s0.to(tl.uint32)
    s1 = s1.to(tl.uint32)
    c = tl.arange(0, BD)
    top, total = _statistics(
        pid, i, q_row, kz, gl_row, rho_ptr, nb_ptr, off_ptr, valid_ptr, J, M, G, d, e, D, T,
        HAS_GL, GL_V, HAS_RHO, HAS_OFFSETS, HAS_VALID, SINGLE, BJ, BM, BG, BT,
    )  # fmt: skip
    k = tl.arange(0, BT)
    g = tl.arange(0, BG)
    tl.store(lse_ptr + (pid * T + k[:, None]) * G + g[None, :], top + tl.log(total),
             mask=(k < T)[:, None] & (g < G)[None, :])  # fmt: skip
    acc = tl.full((BO, BD), 0.0, q_row.dtype.element_ty)
    for j0 in range(0, J, BJ):
        j, rows, counts, pi, t, _, _ = _block(
            pid, i, j0, q_row, kz, gl_row, rho_ptr, nb_ptr, off_ptr, valid_ptr, J, M, G, d, e,
            D, T, HAS_GL, GL_V, HAS_RHO, HAS_OFFSETS, HAS_VALID, SINGLE, BJ, BM, BG, BT,
        )  # fmt: skip
        keep = counts[:, :, None]  # a stand-in where nothing is dropped
        if DROP:
            keep = _keep(pid, j, J, M, G, s0, s1, threshold, BM, BG)
            if not GL_V:
                pi = tl.where(keep, pi, 0.0)
        beta = tl.exp(t - top[:, None, :]) / total[:, None, :]  # (BT, BJ, BG)
        if GL_V:
            mixed = _mixed(pi, gl_row, counts, keep, beta, M, G, T, DROP, BJ, BM, BG, BT)
        for ch in range(d):
            vc = tl.load(vz + rows * d + ch, mask=counts, other=0.0)  # (BJ, BM)
            if GL_V:
                oc = tl.sum(tl.sum(mixed * vc[None, :, :], axis=2), axis=1)  # (BT,)
            else:
                w = tl.sum(pi * vc[:, :, None], axis=1)  # (BJ, BG): W[j, g, ch]
                if SINGLE:
                    oc = tl.sum(tl.sum(beta * w[None, :, :], axis=1), axis=0)  # (BG,)
                else:
                    oc = tl.sum(tl.sum(beta * w[None, :, :], axis=2), axis=1)  # (BT,)
            acc = tl.where(c[None, :] == ch, acc + oc[:, None], acc)
    v = tl.arange(0, BV)
    # sum form without a spatial term (BO = 1): every v has the same row
    tl.store(out_ptr + (pid * V + v[:, None]) * d + c[None, :], tl.broadcast_to(acc, (BV, BD)),
             mask=(v < V)[:, None] & (c < d)[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["s0", "s1", "threshold"])
def attention_backward(
    dq_ptr, dk_ptr, dv_ptr, dgl_ptr, drho_ptr, go_ptr, lse_ptr,
    q_ptr, k_ptr, v_ptr, gl_ptr, rho_ptr, off_ptr, nb_ptr, valid_ptr,
    L, Lkv, J, M, G, d, e, D, V, T, s0, s1, threshold, GO, COPIES,
    HAS_GL: tl.constexpr, GL_V: tl.constexpr, HAS_RHO: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, HAS_VALID: tl.constexpr, SINGLE: tl.constexpr,
    DROP: tl.constexpr,
    BJ: tl.constexpr, BM: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
    BO: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """dq ``(Z, L, G, d)`` and dgl ``(Z, L, M, G)`` written, dk, dv ``(Z, Lkv, M, d)`` and
    drho ``(COPIES, V, D, e)`` added to (zeroed by the caller; program p adds to copy p mod
    COPIES), from go = dL/dout ``(Z, L, GO, d)`` (GO = 1 where every v has the same output
    row: their gradients summed) and the forward's log-sum-exp ``(Z, L, T, G)``; one query
    per program (grid: Z L). GL_V: dgl ``(Z, L, V, M, G)`` added to (zeroed by the caller),
    each query's rows by its program only."""
    pid = tl.program_id(0).to(tl.int64)
    drho_ptr += (pid % COPIES) * V * D * e
    z = pid // L
    i = pid % L
    q_row = q_ptr + pid * G * d
    kz = k_ptr + z * Lkv * M * d
    vz = v_ptr + z * Lkv * M * d
    dkz = dk_ptr + z * Lkv * M * d
    dvz = dv_ptr + z * Lkv * M * d
    if GL_V:
        gl_row = gl_ptr + pid * V * M * G
    else:
        gl_row = gl_ptr + pid * M * G
    go_row = go_ptr + pid * GO * d  # (GO, d)
    s0 = s0.to(tl.uint32)
    s1 = s1.to(tl.uint32)
    dtype = q_row.dtype.element_ty
    k = tl.arange(0, BT)
    g = tl.arange(0, BG)
    m = tl.arange(0, BM)
    c = tl.arange(0, BD)
    g_ok = g < G
    gl_ok = (m < M)[:, None] & g_ok[None, :]  # (BM, BG)
    # padding rows get +inf: beta = 0 there
    lse_t = tl.load(lse_ptr + (pid * T + k[:, None]) * G + g[None, :],
                  mask=(k < T)[:, None] & g_ok[None, :], other=float("inf"))  # fmt: skip

    # 2. A = sum_j beta dbeta
    big_a = tl.full((BT, BG), 0.0, dtype)
    for j0 in range(0, J, BJ):
        j, rows, counts, pi, t, _, _ = _block(
            pid, i, j0, q_row, kz, gl_row, rho_ptr, nb_ptr, off_ptr, valid_ptr, J, M, G, d, e,
            D, T, HAS_GL, GL_V, HAS_RHO, HAS_OFFSETS, HAS_VALID, SINGLE, BJ, BM, BG, BT,
        )  # fmt: skip
        beta = tl.exp(t - lse_t[:, None, :])  # (BT, BJ, BG)
        keep = counts[:, :, None]  # a stand-in where nothing is dropped
        if DROP:
            keep = _keep(pid, j, J, M, G, s0, s1, threshold, BM, BG)
        if GL_V:  # dP[v, j, m] = sum_c go[v, c] v[j, m, c]; dbeta_v = sum_m pik_v dP_v
            dmixed = tl.full((BT, BJ, BM), 0.0, dtype)
            for ch in range(d):
                vc = tl.load(vz + rows * d + ch, mask=counts, other=0.0)  # (BJ, BM)
                goc = tl.load(go_row + k * d + ch, mask=k < T, other=0.0)  # (BT,)
                dmixed += goc[:, None, None] * vc[None, :, :]
            for v in range(T):
                pik, lse = _inner(pi, gl_row + v * M * G, counts, M, G, True, BM, BG)
                if DROP:
                    pik = tl.where(keep, pik, 0.0)
                dbeta = tl.sum(pik * _row(dmixed, k, v)[:, :, None], axis=1)  # (BJ, BG)
                a = tl.sum(_row(beta, k, v) * dbeta, axis=0)  # (BG,)
                big_a = tl.where(k[:, None] == v, big_a + a[None, :], big_a)
        else:
            if DROP:
                pi = tl.where(keep, pi, 0.0)
            dbeta = tl.full((BT, BJ, BG), 0.0, dtype)
            for ch in range(d):
                vc = tl.load(vz + rows * d + ch, mask=counts, other=0.0)  # (BJ, BM)
                if SINGLE:  # go[g, ch] (1, 1, BG)
                    goc = tl.load(go_row + g * d + ch, mask=g_ok, other=0.0)[None, None, :]
                else:  # go[k, ch] (BT, 1, 1)
                    goc = tl.load(go_row + k * d + ch, mask=k < T, other=0.0)[:, None, None]
                dbeta += goc * tl.sum(pi * vc[:, :, None], axis=1)[None, :, :]
            big_a += tl.sum(beta * dbeta, axis=1)

    # 3. gradients
    dq = tl.full((BG, BD), 0.0, dtype)
    dgl = tl.full((BM, BG), 0.0, dtype)
    for j0 in range(0, J, BJ):
        j, rows, counts, pi, t, table, table_ok = _block(
            pid, i, j0, q_row, kz, gl_row, rho_ptr, nb_ptr, off_ptr, valid_ptr, J, M, G, d, e,
            D, T, HAS_GL, GL_V, HAS_RHO, HAS_OFFSETS, HAS_VALID, SINGLE, BJ, BM, BG, BT,
        )  # fmt: skip
        beta = tl.exp(t - lse_t[:, None, :])  # (BT, BJ, BG)
        keep = counts[:, :, None]  # a stand-in where nothing is dropped
        if DROP:
            keep = _keep(pid, j, J, M, G, s0, s1, threshold, BM, BG)
        if GL_V:
            dmixed = tl.full((BT, BJ, BM), 0.0, dtype)
            for ch in range(d):
                vc = tl.load(vz + rows * d + ch, mask=counts, other=0.0)  # (BJ, BM)
                goc = tl.load(go_row + k * d + ch, mask=k < T, other=0.0)  # (BT,)
                dmixed += goc[:, None, None] * vc[None, :, :]
            mixed = tl.full((BT, BJ, BM), 0.0, dtype)
            dt = tl.full((BT, BJ, BG), 0.0, dtype)
            dc = tl.full((BJ, BM, BG), 0.0, dtype)  # sum_v dc_v
            for v in range(T):
                pi_v, lse = _inner(pi, gl_row + v * M * G, counts, M, G, True, BM, BG)
                pik = pi_v
                if DROP:
                    pik = tl.where(keep, pi_v, 0.0)
                row = k[:, None, None] == v
                beta_v = _row(beta, k, v)  # (BJ, BG)
                dmixed_v = _row(dmixed, k, v)  # (BJ, BM)
                a = tl.sum(tl.where(k[:, None] == v, big_a, 0.0), axis=0)  # (BG,)
                dt_v = beta_v * (tl.sum(pik * dmixed_v[:, :, None], axis=1) - a[None, :])
                dt = tl.where(row, dt_v[None, :, :], dt)
                mixed_v = tl.sum(pik * beta_v[:, None, :], axis=2)  # (BJ, BM)
                mixed = tl.where(row, mixed_v[None, :, :], mixed)
                dpi = beta_v[:, None, :] * dmixed_v[:, :, None]  # (BJ, BM, BG)
                if DROP:
                    dpi = tl.where(keep, dpi, 0.0)
                shift = tl.sum(pi_v * dpi, axis=1) - dt_v  # (BJ, BG): dlse_v = dt_v
                dc_v = pi_v * (dpi - shift[:, None, :])
                dc += dc_v
                dgl_v = dgl_ptr + ((pid * V + v) * M + m[:, None]) * G + g[None, :]
                tl.atomic_add(dgl_v, tl.sum(dc_v, axis=0), mask=gl_ok)
            for ch in range(d):  # dv[j, m] += sum_v P[v, j, m] go[v]
                goc = tl.load(go_row + k * d + ch, mask=k < T, other=0.0)  # (BT,)
                dvc = tl.sum(mixed * goc[:, None, None], axis=0)  # (BJ, BM)
                tl.atomic_add(dvz + rows * d + ch, dvc, mask=counts)
        else:
            pik = pi
            if DROP:
                pik = tl.where(keep, pi, 0.0)
            dbeta = tl.full((BT, BJ, BG), 0.0, dtype)
            dpi = tl.full((BJ, BM, BG), 0.0, dtype)
            for ch in range(d):
                vc = tl.load(vz + rows * d + ch, mask=counts, other=0.0)  # (BJ, BM)
                if SINGLE:
                    goc = tl.load(go_row + g * d + ch, mask=g_ok, other=0.0)[None, None, :]
                else:
                    goc = tl.load(go_row + k * d + ch, mask=k < T, other=0.0)[:, None, None]
                dw = tl.sum(beta * goc, axis=0)  # (BJ, BG): dW[j, g, ch]
                dbeta += goc * tl.sum(pik * vc[:, :, None], axis=1)[None, :, :]
                dpi += vc[:, :, None] * dw[:, None, :]
                dvc = tl.sum(pik * dw[:, None, :], axis=2)  # (BJ, BM)
                tl.atomic_add(dvz + rows * d + ch, dvc, mask=counts)
            dt = beta * (dbeta - big_a[:, None, :])  # (BT, BJ, BG)
            dlse = tl.sum(dt, axis=0)  # (BJ, BG)
            if DROP:
                dpi = tl.where(keep, dpi, 0.0)
            shift = tl.sum(pi * dpi, axis=1) - dlse  # (BJ, BG)
            dc = pi * (dpi - shift[:, None, :])  # (BJ, BM, BG)
            if HAS_GL:
                dgl += tl.sum(dc, axis=0)
        if HAS_RHO:  # drho[k, off] += sum_g dt q[g, :e]; dq[g, :e] += sum_(k, j) dt rho[k, off]
            for ch in range(e):
                qc = tl.load(q_row + g * d + ch, mask=g_ok, other=0.0)
                part = dt * qc[None, None, :]
                if not SINGLE:
                    part = tl.sum(part, axis=2, keep_dims=True)  # (BT, BJ, 1)
                tl.atomic_add(drho_ptr + table + ch, part, mask=table_ok)
                r = tl.load(rho_ptr + table + ch, mask=table_ok, other=0.0)
                dqc = tl.sum(tl.sum(dt * r, axis=0), axis=0)  # (BG,)
                dq = tl.where(c[None, :] == ch, dq + dqc[:, None], dq)
        # dq[g] += sum_(j, m) dc k[j, m]; dk[j, m] += sum_g dc q[g]; with GL_V, dc summed over v
        for ch in range(d):
            kc = tl.load(kz + rows * d + ch, mask=counts, other=0.0)  # (BJ, BM)
            qc = tl.load(q_row + g * d + ch, mask=g_ok, other=0.0)  # (BG,)
            dqc = tl.sum(tl.sum(dc * kc[:, :, None], axis=0), axis=0)  # (BG,)
            dq = tl.where(c[None, :] == ch, dq + dqc[:, None], dq)
            tl.atomic_add(dkz + rows * d + ch, tl.sum(dc * qc[None, None, :], axis=2), mask=counts)
    tl.store(dq_ptr + pid * G * d + g[:, None] * d + c[None, :], dq,
             mask=g_ok[:, None] & (c < d)[None, :])  # fmt: skip
    if HAS_GL and not GL_V:
        tl.store(dgl_ptr + pid * M * G + m[:, None] * G + g[None, :], dgl, mask=gl_ok)
