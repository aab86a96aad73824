"""The fused Triton kernel of the factorised attention core: the equations of
:mod:`symattn_cli.nn.gsa.core` (which states the algorithm and the letters) over tiles of
queries; :mod:`symattn_cli.nn.gsa.triton_tiles` builds the tiles and launches it.

A program takes BQ query points of one batch-head with all their G elements, q ``(BQ G, d)``
resident, and visits the union of their neighbours, the tile's *halo* (``halo (NT, H)``: key
points, each repeated as often as one query lists it), BH points at a time, with all M
elements. ``slot (NT, BQ, H)`` says which neighbour j of query iq a halo point is (-1: none:
outside its window, invalid, or padding) and ``row (NT, BQ, H)`` its row of rho (global
layers; local ones read row j). Both products are matrix products (``tl.dot``):

  S[(i, g), (h, m)] = q . k                      Q (BQ G, d)  @ K^T (d, BH M)
  out[(i, r), c]   += P[(i, r), (h, m)] val      P (BQ R, BH M) @ Val (BH M, d)

with the inner softmax pi = softmax_m(S + gl_r) and lse_r over m, the outer logits
t_r = lse_r + q[:, :e] . rho[r, row] (-inf off the slots) and beta_r = exp(t_r - LSE_r), its
log-sum-exp over the halo. No logarithm is taken per entry: lse_r = imax_r + log isum_r (the
maximum over m and the sum of exp(. - imax_r)), so beta_r = isum_r exp(y_r - LSE_r) with
y_r = imax_r + q[:, :e] . rho[r, row]. The mixed weights P[i, r, h, m] = sum_g beta_r pik_r
(pik = pi keep) in the sum form, with R = T rows r (T = V with a spatial term or a group term
that depends on v, else 1); in the single form (g = v) P[i, g, h, m] = beta pik, R = G rows,
rho read at row g.
The group logits gl_r[i, g, m] = q[i, g, d-c:] . grho[r, g, m] are formed in the kernel from
the encoding grho ``(Vg, G, M, c)`` (Vg = V when it depends on v: GL_V).

  forward   1. LSE, the outer softmax's log-sum-exp over the halo (online), written as
               lse_t (Z, L, T, G) for the backward
            2. out
  backward  1. A[i, r, g] = sum_h beta_r dbeta_r, dbeta_r = sum_m pik_r dP_r, dP = GO Val^T
            2. dVal = P^T GO, dt_r = beta_r (dbeta_r - A_r), dpi_r = keep beta_r dP_r,
               dc_r = pi_r (dpi_r - sum_m pi_r dpi_r + dlse_r) (dlse_r = dt_r; summed over r
               first when pi does not depend on r), dS = sum_r dc_r;
               dq = dS K (+ the spatial and group terms' parts), dK = dS^T Q; d grho from
               dgl_r = sum_h dc_r summed over the tile; drho from dt_r.

dK and dVal are added to dk, dv once per (program, block) (atomic adds of the block's sum);
d grho is summed per program into its own row of ``dgrho (programs, Vg, G, M, c)``, which the
caller reduces, so it is deterministic; drho is added per (query, halo point) entry, into
copy pid mod COPIES of it (the caller sums the copies). On a GPU
the atomic adds make dk, dv and drho vary at round-off level from run to run. Accumulation is
in the inputs' dtype (float32 products on tensor cores at float32 accuracy, ``tf32x3``; float64
on its own units).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _keep(zl, slot, J, M, G, s0, s1, threshold, BG: tl.constexpr, BM: tl.constexpr):
    """The dropout keep mask ``(BQ, BG, BH, BM)`` of queries ``zl`` = z L + i ``(BQ,)`` at
    neighbours ``slot`` ``(BQ, BH)``, as common.keep_mask: the flat index into (Z, L, J, M, G),
    its low word xor s0 mixed by the "lowbias32" hash, xor s1 and the high word, mixed again;
    kept if 15 bits >= threshold."""
    g = tl.arange(0, BG)[None, :, None, None]
    m = tl.arange(0, BM)[None, None, None, :]
    jj = slot.to(tl.int64)[:, None, :, None]
    flat = ((zl[:, None, None, None] * J + jj) * M + m) * G + g
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
def _group_logits(qt, grho_ptr, r, G, M, c, BG: tl.constexpr, BM: tl.constexpr,
                  BC: tl.constexpr):  # fmt: skip
    """gl_r[i, g, m] = qt[i, g, :] . grho[r, g, m, :] ``(BQ, BG, BM)`` from the queries' last
    c channels qt ``(BQ, BG, BC)``."""
    g = tl.arange(0, BG)[:, None, None]
    m = tl.arange(0, BM)[None, :, None]
    cc = tl.arange(0, BC)[None, None, :]
    enc = tl.load(grho_ptr + ((r * G + g) * M + m) * c + cc,
                  mask=(g < G) & (m < M) & (cc < c), other=0.0)  # (BG, BM, BC)  # fmt: skip
    return tl.sum(qt[:, :, None, :] * enc[None, :, :, :], axis=3)


@triton.jit
def _inner(s, gl, counts, M, G, HAS_GL: tl.constexpr, BG: tl.constexpr, BM: tl.constexpr):
    """The inner softmax over m of s = q . k ``(BQ, BG, BH, BM)`` plus the group logits ``gl``
    ``(BQ, BG, BM)``: pi (0 where (i, h) is no neighbour and in the padding), and its log-sum-exp
    as imax + log isum, the maximum over m and the sum of exp(. - imax) ``(BQ, BG, BH)``."""
    m = tl.arange(0, BM)[None, None, None, :]
    g = tl.arange(0, BG)[None, :, None, None]
    if HAS_GL:
        s += gl[:, :, None, :]
    s = tl.where(m < M, s, float("-inf"))
    top = tl.max(s, axis=3)  # finite: m = 0 always counts
    p = tl.exp(s - top[:, :, :, None])
    total = tl.sum(p, axis=3)
    pi = tl.where(counts[:, None, :, None] & (g < G), p * (1.0 / total)[:, :, :, None], 0.0)
    return pi, top, total


@triton.jit
def _row_softmax(s, qt, grho_ptr, r, counts, M, G, c, BG: tl.constexpr, BM: tl.constexpr,
                 BC: tl.constexpr):  # fmt: skip
    """:func:`_inner` of s plus row r of a v-dependent group term."""
    gl = _group_logits(qt, grho_ptr, r, G, M, c, BG, BM, BC)  # (BQ, BG, BM)
    return _inner(s, gl, counts, M, G, True, BG, BM)


@triton.jit
def _spatial(qe, rho_ptr, r, where, counts, D, e, G, SINGLE: tl.constexpr, BG: tl.constexpr,
             BE: tl.constexpr):  # fmt: skip
    """rho at table row r (single form: row g) and offsets ``where`` ``(BQ, BH)``:
    ``(BQ, BH, BE)`` (single: ``(BQ, BG, BH, BE)``), 0 off the slots; and the spatial logits
    s_r[i, g, h] = qe[i, g, :] . rho ``(BQ, BG, BH)`` from the queries' first e channels qe
    ``(BQ, BG, BE)``."""
    ch = tl.arange(0, BE)[None, None, :]
    if SINGLE:
        g = tl.arange(0, BG)[None, :, None, None]
        at = (g * D + where[:, None, :, None]) * e + ch[:, None, :, :]
        ok = counts[:, None, :, None] & (g < G) & (ch[:, None, :, :] < e)
        table = tl.load(rho_ptr + at, mask=ok, other=0.0)  # (BQ, BG, BH, BE)
        s = tl.sum(qe[:, :, None, :] * table, axis=3)
    else:
        at = (r * D + where[:, :, None]) * e + ch
        table = tl.load(rho_ptr + at, mask=counts[:, :, None] & (ch < e), other=0.0)
        s = tl.sum(qe[:, :, None, :] * table[:, None, :, :], axis=3)
    return table, s


@triton.jit
def _row3(x, r, BR: tl.constexpr):
    """Row r of x ``(BQ, BR, B)`` along its second axis: ``(BQ, B)``."""
    rr = tl.arange(0, BR)[None, :, None]
    return tl.sum(tl.where(rr == r, x, 0.0), axis=1)


@triton.jit
def _tile(q_ptr, z, t, L, G, d, c, e, BQ: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
          BC: tl.constexpr, BE: tl.constexpr):  # fmt: skip
    """The tile's queries: z L + i ``(BQ,)``, whether i < L, q ``(BQ G, BD)``, its last c
    channels ``(BQ, BG, BC)`` and its first e ``(BQ, BG, BE)``."""
    iq = tl.arange(0, BQ)
    i = t * BQ + iq
    q_ok = i < L
    zl = z * L + i.to(tl.int64)
    g = tl.arange(0, BG)[None, :, None]
    base = q_ptr + (zl[:, None, None] * G + g) * d
    row_ok = q_ok[:, None, None] & (g < G)
    ch = tl.arange(0, BD)[None, None, :]
    q = tl.load(base + ch, mask=row_ok & (ch < d), other=0.0)
    cc = tl.arange(0, BC)[None, None, :]
    qt = tl.load(base + d - c + cc, mask=row_ok & (cc < c), other=0.0)
    ce = tl.arange(0, BE)[None, None, :]
    qe = tl.load(base + ce, mask=row_ok & (ce < e), other=0.0)
    return zl, q_ok, tl.reshape(q, (BQ * BG, BD)), qt, qe


@triton.jit
def _block(h0, t, H, halo_ptr, slot_ptr, row_ptr, q_ok, kz, M, d,
           HAS_OFFSETS: tl.constexpr, BQ: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr,
           BD: tl.constexpr):  # fmt: skip
    """Halo points h0 .. h0 + BH of tile t: the rows of k and v at their elements
    ``(BH, BM)`` and which exist, the neighbour slot of each (query, point) ``(BQ, BH)``
    (-1: none), whether it counts, where its spatial term reads rho, and the keys
    ``(BH BM, BD)``."""
    h = h0 + tl.arange(0, BH)
    iq = tl.arange(0, BQ)
    point = tl.load(halo_ptr + t * H + h)  # (BH,), -1: padding
    m = tl.arange(0, BM)
    rows = point.to(tl.int64)[:, None] * M + m[None, :]  # (BH, BM)
    exists = (point >= 0)[:, None] & (m < M)[None, :]
    at = (t * BQ + iq[:, None]) * H + h[None, :]  # (BQ, BH)
    slot = tl.load(slot_ptr + at)
    counts = (slot >= 0) & q_ok[:, None]
    if HAS_OFFSETS:
        where = tl.load(row_ptr + at, mask=counts, other=0)
    else:
        where = slot
    ch = tl.arange(0, BD)[None, None, :]
    keys = tl.load(kz + rows[:, :, None] * d + ch, mask=exists[:, :, None] & (ch < d), other=0.0)
    return rows, exists, slot, counts, where, tl.reshape(keys, (BH * BM, BD))


@triton.jit
def _values(vz, rows, exists, d, BH: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    """The values of a block ``(BH BM, BD)``."""
    ch = tl.arange(0, BD)[None, None, :]
    vals = tl.load(vz + rows[:, :, None] * d + ch, mask=exists[:, :, None] & (ch < d), other=0.0)
    return tl.reshape(vals, (BH * BM, BD))


@triton.jit
def _product(a, b, PRECISION: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr,
             S2: tl.constexpr, S3: tl.constexpr):  # fmt: skip
    """a b^T ``(S0 S1, S2 S3)`` for a ``(S0 S1, K)`` and b ``(S2 S3, K)``, as ``(S0, S1, S2,
    S3)``."""
    product = tl.dot(a, tl.trans(b), input_precision=PRECISION, out_dtype=a.dtype)
    return tl.reshape(product, (S0, S1, S2, S3))


@triton.jit
def _scores(
    h0, t, H, halo_ptr, slot_ptr, row_ptr, q_ok, kz, q2, qt, grho_ptr, M, G, d, c,
    HAS_GL: tl.constexpr, GL_V: tl.constexpr, HAS_OFFSETS: tl.constexpr, PRECISION: tl.constexpr,
    BQ: tl.constexpr, BH: tl.constexpr, BG: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
    BC: tl.constexpr,
):  # fmt: skip
    """A halo block (:func:`_block`), its dot products s ``(BQ, BG, BH, BM)`` and the inner
    softmax pi, imax, isum at the group term's row 0, which a v-dependent group term (GL_V)
    forms per row instead (:func:`_row_softmax`; zeros stand in here)."""
    rows, exists, slot, counts, where, keys = _block(
        h0, t, H, halo_ptr, slot_ptr, row_ptr, q_ok, kz, M, d, HAS_OFFSETS, BQ, BH, BM, BD
    )
    s4 = _product(q2, keys, PRECISION, BQ, BG, BH, BM)
    if GL_V:
        pi = s4
        imax = tl.zeros((BQ, BG, BH), s4.dtype)
        isum = imax
    else:
        gl = _group_logits(qt, grho_ptr, 0, G, M, c, BG, BM, BC)
        pi, imax, isum = _inner(s4, gl, counts, M, G, HAS_GL, BG, BM)
    return rows, exists, slot, counts, where, keys, s4, pi, imax, isum


@triton.jit
def _outer(imax, qe, rho_ptr, r, where, counts, D, e, G, HAS_RHO: tl.constexpr,
           SINGLE: tl.constexpr, BG: tl.constexpr, BE: tl.constexpr):  # fmt: skip
    """The outer logits less log isum, y_r = imax + s_r ``(BQ, BG, BH)`` (t_r = y_r + log isum),
    -inf where (i, h) is no neighbour."""
    t = imax
    if HAS_RHO:
        _, s = _spatial(qe, rho_ptr, r, where, counts, D, e, G, SINGLE, BG, BE)
        t += s
    return tl.where(counts[:, None, :], t, float("-inf"))


@triton.jit
def _beta(y, isum, lse_all, r, counts, BT: tl.constexpr):
    """beta_r = exp(t_r - LSE_r) = isum exp(y_r - LSE_r) ``(BQ, BG, BH)``, 0 off the slots."""
    return tl.where(counts[:, None, :], isum * tl.exp(y - _row3(lse_all, r, BT)[:, :, None]), 0.0)


@triton.jit
def _mix(s4, pi, imax, isum, qt, grho_ptr, rho_ptr, qe, lse_all, keep, where, counts, G, M, c,
         D, e, T,
         GL_V: tl.constexpr, HAS_RHO: tl.constexpr, SINGLE: tl.constexpr, DROP: tl.constexpr,
         BQ: tl.constexpr, BG: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr,
         BC: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr):  # fmt: skip
    """The mixed weights P ``(BQ, BR, BH, BM)`` of a block from its dot products ``s4``, the
    inner softmax at the group term's row 0 (:func:`_scores`) and the outer log-sum-exp
    ``lse_all`` ``(BQ, BT, BG)``."""
    if DROP:
        if not GL_V:
            pi = tl.where(keep, pi, 0.0)
    if SINGLE:
        y = _outer(imax, qe, rho_ptr, 0, where, counts, D, e, G, HAS_RHO, SINGLE, BG, BE)
        return _beta(y, isum, lse_all, 0, counts, BT)[:, :, :, None] * pi
    mixed = tl.full((BQ, BR, BH, BM), 0.0, s4.dtype)
    rr = tl.arange(0, BR)[None, :, None, None]
    for r in range(T):
        if GL_V:
            pi, imax, isum = _row_softmax(s4, qt, grho_ptr, r, counts, M, G, c, BG, BM,
                                          BC)  # fmt: skip
            if DROP:
                pi = tl.where(keep, pi, 0.0)
        y = _outer(imax, qe, rho_ptr, r, where, counts, D, e, G, HAS_RHO, SINGLE, BG, BE)
        beta = _beta(y, isum, lse_all, r, counts, BT)
        p = tl.sum(beta[:, :, :, None] * pi, axis=1)  # (BQ, BH, BM)
        mixed = tl.where(rr == r, p[:, None, :, :], mixed)
    return mixed


@triton.jit
def _again(
    h0, t, H, halo_ptr, slot_ptr, row_ptr, q_ok, kz, vz, q2, go2, qt, grho_ptr, zl, J, M, G, d,
    c, s0, s1, threshold, HAS_GL: tl.constexpr, GL_V: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    DROP: tl.constexpr, PRECISION: tl.constexpr, BQ: tl.constexpr, BH: tl.constexpr,
    BG: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    """What both backward passes recompute for a halo block (:func:`_scores`): also its
    values, dP = GO Val^T ``(BQ, BR, BH, BM)`` and the keep mask (a stand-in without
    dropout)."""
    rows, exists, slot, counts, where, keys, s4, pi, imax, isum = _scores(
        h0, t, H, halo_ptr, slot_ptr, row_ptr, q_ok, kz, q2, qt, grho_ptr, M, G, d, c, HAS_GL,
        GL_V, HAS_OFFSETS, PRECISION, BQ, BH, BG, BM, BD, BC,
    )  # fmt: skip
    vals = _values(vz, rows, exists, d, BH, BM, BD)
    dmix = _product(go2, vals, PRECISION, BQ, BR, BH, BM)
    keep = counts[:, None, :, None]
    if DROP:
        keep = _keep(zl, slot, J, M, G, s0, s1, threshold, BG, BM)
    return rows, exists, counts, where, keys, vals, s4, dmix, keep, pi, imax, isum


# The seed changes with every call: no variant compiled for one that is 1 or a multiple of 16.
@triton.jit(do_not_specialize=["s0", "s1", "threshold"])
def attention_forward(
    out_ptr, lse_ptr, q_ptr, k_ptr, v_ptr, grho_ptr, rho_ptr, halo_ptr, slot_ptr, row_ptr,
    L, Lkv, NT, H, J, M, G, d, c, e, D, V, T, s0, s1, threshold,
    HAS_GL: tl.constexpr, GL_V: tl.constexpr, HAS_RHO: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, SINGLE: tl.constexpr, DROP: tl.constexpr,
    BQ: tl.constexpr, BH: tl.constexpr, BG: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
    BC: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """out ``(Z, L, V, d)`` and the outer softmax's log-sum-exp ``(Z, L, T, G)``, one tile of
    BQ queries per program (grid: Z NT)."""
    pid = tl.program_id(0).to(tl.int64)
    z = pid // NT
    t = pid % NT
    zl, q_ok, q2, qt, qe = _tile(q_ptr, z, t, L, G, d, c, e, BQ, BG, BD, BC, BE)
    kz = k_ptr + z * Lkv * M * d
    vz = v_ptr + z * Lkv * M * d
    s0 = s0.to(tl.uint32)
    s1 = s1.to(tl.uint32)
    dtype = q2.dtype
    rr = tl.arange(0, BT)[None, :, None]
    g = tl.arange(0, BG)[None, None, :]

    # 1. the outer statistics, online over the halo
    top = tl.full((BQ, BT, BG), float("-inf"), dtype)
    total = tl.full((BQ, BT, BG), 0.0, dtype)
    for h0 in range(0, H, BH):
        _, _, _, counts, where, _, s4, pi, imax, isum = _scores(
            h0, t, H, halo_ptr, slot_ptr, row_ptr, q_ok, kz, q2, qt, grho_ptr, M, G, d, c, HAS_GL,
            GL_V, HAS_OFFSETS, PRECISION, BQ, BH, BG, BM, BD, BC,
        )  # fmt: skip
        for r in range(T):
            if GL_V:
                pi, imax, isum = _row_softmax(s4, qt, grho_ptr, r, counts, M, G, c, BG, BM,
                                              BC)  # fmt: skip
            y = _outer(imax, qe, rho_ptr, r, where, counts, D, e, G, HAS_RHO, SINGLE, BG, BE)
            new = tl.maximum(_row3(top, r, BT), tl.max(y, axis=2))  # (BQ, BG)
            safe = tl.where(new == float("-inf"), 0.0, new)
            add = tl.sum(isum * tl.exp(y - safe[:, :, None]), axis=2)
            grown = _row3(total, r, BT) * tl.exp(_row3(top, r, BT) - safe) + add
            top = tl.where(rr == r, new[:, None, :], top)
            total = tl.where(rr == r, grown[:, None, :], total)
    # 0 for a query with no neighbour (the padding): its weights are 0 anyway
    lse_all = tl.where(total > 0, top + tl.log(tl.where(total > 0, total, 1.0)), 0.0)
    tl.store(lse_ptr + (zl[:, None, None] * T + rr) * G + g, lse_all,
             mask=q_ok[:, None, None] & (rr < T) & (g < G))  # fmt: skip

    # 2. out = P Val
    acc = tl.full((BQ * BR, BD), 0.0, dtype)
    for h0 in range(0, H, BH):
        rows, exists, slot, counts, where, _, s4, pi, imax, isum = _scores(
            h0, t, H, halo_ptr, slot_ptr, row_ptr, q_ok, kz, q2, qt, grho_ptr, M, G, d, c, HAS_GL,
            GL_V, HAS_OFFSETS, PRECISION, BQ, BH, BG, BM, BD, BC,
        )  # fmt: skip
        keep = counts[:, None, :, None]  # a stand-in where nothing is dropped
        if DROP:
            keep = _keep(zl, slot, J, M, G, s0, s1, threshold, BG, BM)
        mixed = _mix(s4, pi, imax, isum, qt, grho_ptr, rho_ptr, qe, lse_all, keep, where, counts,
                     G, M, c, D, e, T, GL_V, HAS_RHO, SINGLE, DROP, BQ, BG, BH, BM, BC, BE, BT,
                     BR)  # fmt: skip
        vals = _values(vz, rows, exists, d, BH, BM, BD)
        acc += tl.dot(tl.reshape(mixed, (BQ * BR, BH * BM)), vals, input_precision=PRECISION,
                      out_dtype=dtype)  # fmt: skip
    out = tl.reshape(acc, (BQ, BR, BD))
    ch = tl.arange(0, BD)[None, None, :]
    ok = q_ok[:, None, None] & (ch < d)
    if BR == 1:  # sum form without a spatial or v-dependent term: every v has the same row
        vv = tl.arange(0, BV)[None, :, None]
        tl.store(out_ptr + (zl[:, None, None] * V + vv) * d + ch,
                 tl.broadcast_to(out, (BQ, BV, BD)), mask=ok & (vv < V))  # fmt: skip
    else:
        vv = tl.arange(0, BR)[None, :, None]
        tl.store(out_ptr + (zl[:, None, None] * V + vv) * d + ch, out, mask=ok & (vv < V))


@triton.jit(do_not_specialize=["s0", "s1", "threshold"])
def attention_backward(
    dq_ptr, dk_ptr, dv_ptr, dgrho_ptr, drho_ptr, go_ptr, lse_ptr,
    q_ptr, k_ptr, v_ptr, grho_ptr, rho_ptr, halo_ptr, slot_ptr, row_ptr,
    L, Lkv, NT, H, J, M, G, d, c, e, D, V, T, s0, s1, threshold, GO, COPIES,
    HAS_GL: tl.constexpr, GL_V: tl.constexpr, HAS_RHO: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, SINGLE: tl.constexpr, DROP: tl.constexpr,
    BQ: tl.constexpr, BH: tl.constexpr, BG: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
    BC: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """dq ``(Z, L, G, d)`` and this program's d grho ``(Vg, G, M, c)`` (row ``pid`` of
    ``dgrho``) written; dk, dv ``(Z, Lkv, M, d)`` and drho ``(COPIES, V, D, e)`` added to
    (zeroed by the caller; program p adds to copy p mod COPIES); from go = dL/dout ``(Z, L,
    GO, d)`` (GO = 1 where every v has the same output row: their gradients summed) and the
    forward's log-sum-exp ``(Z, L, T, G)``. Grid: Z NT."""
    pid = tl.program_id(0).to(tl.int64)
    drho_ptr += (pid % COPIES) * V * D * e
    z = pid // NT
    t = pid % NT
    zl, q_ok, q2, qt, qe = _tile(q_ptr, z, t, L, G, d, c, e, BQ, BG, BD, BC, BE)
    kz = k_ptr + z * Lkv * M * d
    vz = v_ptr + z * Lkv * M * d
    dkz = dk_ptr + z * Lkv * M * d
    dvz = dv_ptr + z * Lkv * M * d
    s0 = s0.to(tl.uint32)
    s1 = s1.to(tl.uint32)
    dtype = q2.dtype
    rr = tl.arange(0, BT)[None, :, None]
    g = tl.arange(0, BG)[None, None, :]
    # padding rows get +inf: beta = 0 there
    lse_ok = q_ok[:, None, None] & (rr < T) & (g < G)
    lse_all = tl.load(lse_ptr + (zl[:, None, None] * T + rr) * G + g, mask=lse_ok,
                      other=float("inf"))  # fmt: skip
    ro = tl.arange(0, BR)[None, :, None]
    ch = tl.arange(0, BD)[None, None, :]
    go = tl.load(
        go_ptr + (zl[:, None, None] * GO + ro) * d + ch,
        mask=q_ok[:, None, None] & (ro < GO) & (ch < d),
        other=0.0,
    )  # (BQ, BR, BD)
    go2 = tl.reshape(go, (BQ * BR, BD))

    # 1. A[i, r, g] = sum_h beta_r dbeta_r
    big_a = tl.full((BQ, BT, BG), 0.0, dtype)
    for h0 in range(0, H, BH):
        rows, exists, counts, where, keys, vals, s4, dmix, keep, pi, imax, isum = _again(
            h0, t, H, halo_ptr, slot_ptr, row_ptr, q_ok, kz, vz, q2, go2, qt, grho_ptr, zl, J, M,
            G, d, c, s0, s1, threshold, HAS_GL, GL_V, HAS_OFFSETS, DROP, PRECISION, BQ, BH, BG, BM,
            BD, BC, BR,
        )  # fmt: skip
        if DROP:
            if not GL_V:
                pi = tl.where(keep, pi, 0.0)
        for r in range(T):
            if GL_V:
                pi, imax, isum = _row_softmax(s4, qt, grho_ptr, r, counts, M, G, c, BG, BM,
                                              BC)  # fmt: skip
                if DROP:
                    pi = tl.where(keep, pi, 0.0)
            y = _outer(imax, qe, rho_ptr, r, where, counts, D, e, G, HAS_RHO, SINGLE, BG, BE)
            beta = _beta(y, isum, lse_all, r, counts, BT)
            if SINGLE:  # dP rows are g
                dbeta = tl.sum(pi * dmix, axis=3)
            else:
                dbeta = tl.sum(pi * _row4(dmix, r, BR)[:, None, :, :], axis=3)  # (BQ, BG, BH)
            a = tl.sum(beta * dbeta, axis=2)  # (BQ, BG)
            big_a = tl.where(rr == r, big_a + a[:, None, :], big_a)

    # 2. gradients
    dq2 = tl.full((BQ * BG, BD), 0.0, dtype)
    dqe = tl.full((BQ, BG, BE), 0.0, dtype)  # the spatial term's part of dq[:, :, :e]
    dgl = tl.full((BQ, BT, BG, BM), 0.0, dtype)  # sum_h dc_r (row 0 unless GL_V)
    for h0 in range(0, H, BH):
        rows, exists, counts, where, keys, vals, s4, dmix, keep, pi, imax, isum = _again(
            h0, t, H, halo_ptr, slot_ptr, row_ptr, q_ok, kz, vz, q2, go2, qt, grho_ptr, zl, J, M,
            G, d, c, s0, s1, threshold, HAS_GL, GL_V, HAS_OFFSETS, DROP, PRECISION, BQ, BH, BG, BM,
            BD, BC, BR,
        )  # fmt: skip
        pik = pi
        if DROP:
            if not GL_V:
                pik = tl.where(keep, pi, 0.0)
        mixed = tl.full((BQ, BR, BH, BM), 0.0, dtype)
        ds = tl.full((BQ, BG, BH, BM), 0.0, dtype)  # GL_V: sum_r dc_r; else sum_r dpi_r
        dlse = tl.full((BQ, BG, BH), 0.0, dtype)
        for r in range(T):
            if GL_V:
                pi, imax, isum = _row_softmax(s4, qt, grho_ptr, r, counts, M, G, c, BG, BM,
                                              BC)  # fmt: skip
                pik = pi
                if DROP:
                    pik = tl.where(keep, pi, 0.0)
            y = _outer(imax, qe, rho_ptr, r, where, counts, D, e, G, HAS_RHO, SINGLE, BG, BE)
            beta = _beta(y, isum, lse_all, r, counts, BT)
            if SINGLE:
                dmix_r = dmix  # (BQ, BG, BH, BM): rows are g
                mixed = beta[:, :, :, None] * pik
            else:
                dmix_r = _row4(dmix, r, BR)[:, None, :, :]
                p = tl.sum(beta[:, :, :, None] * pik, axis=1)
                mixed = tl.where(tl.arange(0, BR)[None, :, None, None] == r, p[:, None, :, :],
                                 mixed)  # fmt: skip
            dbeta = tl.sum(pik * dmix_r, axis=3)
            dt = beta * (dbeta - _row3(big_a, r, BT)[:, :, None])  # (BQ, BG, BH)
            dpi = beta[:, :, :, None] * dmix_r
            if DROP:
                dpi = tl.where(keep, dpi, 0.0)
            if GL_V:
                shift = tl.sum(pi * dpi, axis=3) - dt
                dc = pi * (dpi - shift[:, :, :, None])
                ds += dc
                dgl = tl.where(tl.arange(0, BT)[None, :, None, None] == r,
                               dgl + tl.sum(dc, axis=2)[:, None, :, :], dgl)  # fmt: skip
            else:
                ds += dpi
                dlse += dt
            if HAS_RHO:  # drho[r, row] += sum_g dt q[:, :e]; dq[:, :e] += sum_h dt rho[r, row]
                table, _ = _spatial(qe, rho_ptr, r, where, counts, D, e, G, SINGLE, BG, BE)
                ce = tl.arange(0, BE)
                if SINGLE:
                    gg = tl.arange(0, BG)[None, :, None, None]
                    at = (gg * D + where[:, None, :, None]) * e + ce[None, None, None, :]
                    ok = counts[:, None, :, None] & (gg < G) & (ce < e)[None, None, None, :]
                    tl.atomic_add(drho_ptr + at, dt[:, :, :, None] * qe[:, :, None, :], mask=ok)
                    dqe += tl.sum(dt[:, :, :, None] * table, axis=2)
                else:
                    part = tl.sum(dt[:, :, :, None] * qe[:, :, None, :], axis=1)  # (BQ, BH, BE)
                    at = (r * D + where[:, :, None]) * e + ce[None, None, :]
                    ok = counts[:, :, None] & (ce < e)[None, None, :]
                    tl.atomic_add(drho_ptr + at, part, mask=ok)
                    dqe += tl.sum(dt[:, :, :, None] * table[:, None, :, :], axis=2)
        if not GL_V:
            shift = tl.sum(pi * ds, axis=3) - dlse
            ds = pi * (ds - shift[:, :, :, None])
            dgl += tl.sum(ds, axis=2)[:, None, :, :]
        # dVal = P^T GO, dq += dS K, dK = dS^T Q
        dvals = tl.dot(tl.trans(tl.reshape(mixed, (BQ * BR, BH * BM))), go2,
                       input_precision=PRECISION, out_dtype=dtype)  # fmt: skip
        ds2 = tl.reshape(ds, (BQ * BG, BH * BM))
        dq2 += tl.dot(ds2, keys, input_precision=PRECISION, out_dtype=dtype)
        dkeys = tl.dot(tl.trans(ds2), q2, input_precision=PRECISION, out_dtype=dtype)
        kv_at = rows[:, :, None] * d + ch
        kv_ok = exists[:, :, None] & (ch < d)
        tl.atomic_add(dvz + kv_at, tl.reshape(dvals, (BH, BM, BD)), mask=kv_ok)
        tl.atomic_add(dkz + kv_at, tl.reshape(dkeys, (BH, BM, BD)), mask=kv_ok)

    # the group term: d grho[r, g, m] = sum_i dgl_r qt, dq[:, :, d-c:] += sum_(r, m) dgl_r grho
    dq = tl.reshape(dq2, (BQ, BG, BD))
    ce = tl.arange(0, BE)[None, None, :, None]
    dq += tl.sum(dqe[:, :, :, None] * (ce == ch[:, :, None, :]), axis=2)
    if HAS_GL:
        gm = tl.arange(0, BG)[:, None, None]
        mm = tl.arange(0, BM)[None, :, None]
        cc = tl.arange(0, BC)[None, None, :]
        enc_ok = (gm < G) & (mm < M) & (cc < c)
        dqt = tl.full((BQ, BG, BC), 0.0, dtype)
        rows_gl = T if GL_V else 1
        for r in range(T if GL_V else 1):
            dgl_r = _row4(dgl, r, BT)  # (BQ, BG, BM)
            at = ((r * G + gm) * M + mm) * c + cc
            enc = tl.load(grho_ptr + at, mask=enc_ok, other=0.0)  # (BG, BM, BC)
            part = tl.sum(dgl_r[:, :, :, None] * qt[:, :, None, :], axis=0)  # (BG, BM, BC)
            size = rows_gl * G * M * c
            tl.store(dgrho_ptr + pid * size + at, part, mask=enc_ok)
            dqt += tl.sum(dgl_r[:, :, :, None] * enc[None, :, :, :], axis=2)
        cc4 = tl.arange(0, BC)[None, None, :, None]
        dq += tl.sum(dqt[:, :, :, None] * (cc4 + d - c == ch[:, :, None, :]), axis=2)
    gq = tl.arange(0, BG)[None, :, None]
    tl.store(dq_ptr + (zl[:, None, None] * G + gq) * d + ch, dq,
             mask=q_ok[:, None, None] & (gq < G) & (ch < d))  # fmt: skip


@triton.jit
def _row4(x, r, BR: tl.constexpr):
    """Row r of x ``(BQ, BR, A, B)`` along its second axis: ``(BQ, A, B)``."""
    rr = tl.arange(0, BR)[None, :, None, None]
    return tl.sum(tl.where(rr == r, x, 0.0), axis=1)
