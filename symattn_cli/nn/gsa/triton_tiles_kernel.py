"""The fused Triton kernel of the factorised attention core (:mod:`symattn_cli.nn.gsa.core`,
which states the algorithm and the letters) over tiles of queries;
:mod:`symattn_cli.nn.gsa.triton_tiles` builds the tiles and launches it.

A program takes BQ query points of one batch-head with all their G elements, q ``(BQ G, d)``
resident, and visits the union of their neighbours, the tile's *halo* (``halo (NT, H)``: key
points, each repeated as often as one query lists it), BH points at a time, with all M
elements. ``slot (NT, BQ, H)`` says which neighbour j of query iq a halo point is (-1: none:
outside its window, invalid, or padding) and ``row (NT, BQ, H)`` its row of rho (global
layers; local ones read row j).

The two softmaxes of the core are one softmax over (h, m) of the whole logit, for each query
i, outer row r and query element g (beta_r pi_r = exp(x_r - LSE_r), the core's
factorisation read backwards), so the kernel forms it directly, one row r at a time:

  x[i, r, g, h, m] = S[i, g, h, m] + gl[i, r, g, m] + sp[i, r, g, h]     (-inf off the slots)
  S  = q . k                      Q (BQ G, d) @ K^T (d, BH M)            (``tl.dot``, per block)
  gl = q[:, :, d-c:] . grho[r, g, m]     (GL_V: per block and row; else row 0, once a program)
  sp = q[:, :, :e] . rho[r, row]          (single form: rho at row g, one row r)
  W  = exp(x - LSE),  LSE[i, r, g] = logsumexp_(h, m) x
  P[i, r, h, m] = sum_g W keep                 (single form: P[i, g, h, m] = W keep)
  out[(i, r), c] += P[(i, r), (h, m)] val      P (BQ R, BH M) @ Val (BH M, d)  (``tl.dot``)

with R = T rows r (T = V with a spatial term or a group term that depends on v, else 1) in
the sum form, R = G in the single form (g = v, T = 1). Dropout's keep mask is that of pi.

  forward   1. LSE, online over the halo, written as lse (Z, L, T, G) for the backward
            2. out
  backward  with dP = GO Val^T and X = keep dP (broadcast over g; single form: rows g):
            1. A[i, r, g] = sum_(h, m) W X
            2. dx = W (X - A): dS = sum_r dx, dgl = sum_h dx (and over r unless GL_V),
               dsp = sum_m dx; dVal = P^T GO, dq = dS K (+ the spatial and group terms'
               parts), dK = dS^T Q; d grho from dgl summed over the tile; drho from dsp.

dK and dVal are added to dk, dv once per (program, block) (atomic adds of the block's sum);
d grho is summed per program into its own row of ``dgrho (programs, Vg, G, M, c)``, which the
caller reduces, so it is deterministic; drho is added per (query, halo point) entry, into
copy pid mod COPIES of it (the caller sums the copies). On a GPU the atomic adds make dk, dv
and drho vary at round-off level from run to run. Accumulation is in the inputs' dtype
(float32 products on tensor cores at float32 accuracy, ``tf32x3``; float64 on its own units).
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
    S3)``. The longer operand is the product's first: the warps split its rows, where a short
    first one (16 rows) leaves them all computing the same rows."""
    if S0 * S1 < S2 * S3:
        product = tl.trans(tl.dot(b, tl.trans(a), input_precision=PRECISION, out_dtype=a.dtype))
    else:
        product = tl.dot(a, tl.trans(b), input_precision=PRECISION, out_dtype=a.dtype)
    return tl.reshape(product, (S0, S1, S2, S3))


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
def _spatial(qe, rho_ptr, r, where, counts, D, e, G, SINGLE: tl.constexpr, BG: tl.constexpr,
             BE: tl.constexpr):  # fmt: skip
    """rho at table row r (single form: row g) and offsets ``where`` ``(BQ, BH)``:
    ``(BQ, BH, BE)`` (single: ``(BQ, BG, BH, BE)``), 0 off the slots; and the spatial logits
    sp_r[i, g, h] = qe[i, g, :] . rho ``(BQ, BG, BH)`` from the queries' first e channels qe
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
def _row4(x, r, BR: tl.constexpr):
    """Row r of x ``(BQ, BR, A, B)`` along its second axis: ``(BQ, A, B)``."""
    rr = tl.arange(0, BR)[None, :, None, None]
    return tl.sum(tl.where(rr == r, x, 0.0), axis=1)


@triton.jit
def _scores(
    h0, t, H, halo_ptr, slot_ptr, row_ptr, q_ok, kz, q2, M, G, d, HAS_OFFSETS: tl.constexpr,
    PRECISION: tl.constexpr, BQ: tl.constexpr, BH: tl.constexpr, BG: tl.constexpr,
    BM: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """A halo block (:func:`_block`) and its dot products S ``(BQ, BG, BH, BM)``, -inf off the
    slots and past the sizes."""
    rows, exists, slot, counts, where, keys = _block(
        h0, t, H, halo_ptr, slot_ptr, row_ptr, q_ok, kz, M, d, HAS_OFFSETS, BQ, BH, BM, BD
    )
    s = _product(q2, keys, PRECISION, BQ, BG, BH, BM)
    g = tl.arange(0, BG)[None, :, None, None]
    m = tl.arange(0, BM)[None, None, None, :]
    ok = counts[:, None, :, None] & (g < G) & (m < M)
    return rows, exists, slot, counts, where, keys, tl.where(ok, s, float("-inf"))


@triton.jit
def _row_logits(s, gl0, qt, grho_ptr, qe, rho_ptr, r, where, counts, G, M, c, D, e,
                HAS_GL: tl.constexpr, GL_V: tl.constexpr, HAS_RHO: tl.constexpr,
                SINGLE: tl.constexpr, BG: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
                BE: tl.constexpr):  # fmt: skip
    """Row r's logits x_r = S + gl_r + sp_r ``(BQ, BG, BH, BM)`` (``gl0``: the group logits
    when they do not depend on r), and rho at the row (:func:`_spatial`; a stand-in without a
    spatial term)."""
    x = s
    if GL_V:
        x += _group_logits(qt, grho_ptr, r, G, M, c, BG, BM, BC)[:, :, None, :]
    elif HAS_GL:
        x += gl0[:, :, None, :]
    table = where
    if HAS_RHO:
        table, sp = _spatial(qe, rho_ptr, r, where, counts, D, e, G, SINGLE, BG, BE)
        x += sp[:, :, :, None]
    return table, x


@triton.jit
def _kept(x, keep, DROP: tl.constexpr):
    """x where the keep mask keeps it, else 0 (x without dropout)."""
    if DROP:
        x = tl.where(keep, x, 0.0)
    return x


@triton.jit
def _dp_row(dp, r, SINGLE: tl.constexpr, BR: tl.constexpr):
    """dP = GO Val^T at row r, broadcast over g ``(BQ, 1, BH, BM)``; single form: dP itself,
    whose rows are g."""
    if SINGLE:
        return dp
    else:
        return _row4(dp, r, BR)[:, None, :, :]


@triton.jit
def _mix(s, gl0, qt, grho_ptr, qe, rho_ptr, lse, keep, where, counts, G, M, c, D, e, T,
         HAS_GL: tl.constexpr, GL_V: tl.constexpr, HAS_RHO: tl.constexpr,
         SINGLE: tl.constexpr, DROP: tl.constexpr, BQ: tl.constexpr, BG: tl.constexpr,
         BH: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr, BE: tl.constexpr,
         BT: tl.constexpr, BR: tl.constexpr):  # fmt: skip
    """P ``(BQ, BR, BH, BM)`` of a block: sum_g W_r keep in row r (single form: W keep, rows
    g) from its dot products ``s`` and the log-sum-exp ``lse`` ``(BQ, BT, BG)``."""
    if SINGLE:
        _rho, x = _row_logits(s, gl0, qt, grho_ptr, qe, rho_ptr, 0, where, counts, G, M, c, D, e,
                           HAS_GL, GL_V, HAS_RHO, SINGLE, BG, BM, BC, BE)  # fmt: skip
        return _kept(tl.exp(x - _row3(lse, 0, BT)[:, :, None, None]), keep, DROP)
    mixed = tl.full((BQ, BR, BH, BM), 0.0, s.dtype)
    rr = tl.arange(0, BR)[None, :, None, None]
    for r in range(T):
        _rho, x = _row_logits(s, gl0, qt, grho_ptr, qe, rho_ptr, r, where, counts, G, M, c, D, e,
                           HAS_GL, GL_V, HAS_RHO, SINGLE, BG, BM, BC, BE)  # fmt: skip
        w = _kept(tl.exp(x - _row3(lse, r, BT)[:, :, None, None]), keep, DROP)
        mixed = tl.where(rr == r, tl.sum(w, axis=1)[:, None, :, :], mixed)
    return mixed


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
    """out ``(Z, L, V, d)`` and the log-sum-exp LSE ``(Z, L, T, G)``, one tile of BQ queries
    per program (grid: Z NT)."""
    pid = tl.program_id(0).to(tl.int64)
    z = pid // NT
    t = pid % NT
    zl, q_ok, q2, qt, qe = _tile(q_ptr, z, t, L, G, d, c, e, BQ, BG, BD, BC, BE)
    kz = k_ptr + z * Lkv * M * d
    vz = v_ptr + z * Lkv * M * d
    s0 = s0.to(tl.uint32)
    s1 = s1.to(tl.uint32)
    dtype = q2.dtype
    gl0 = qt  # the group logits when they do not depend on r (a stand-in otherwise)
    if HAS_GL and not GL_V:
        gl0 = _group_logits(qt, grho_ptr, 0, G, M, c, BG, BM, BC)
    rr = tl.arange(0, BT)[None, :, None]
    g = tl.arange(0, BG)[None, None, :]

    # 1. LSE, online over the halo
    top = tl.full((BQ, BT, BG), float("-inf"), dtype)
    total = tl.full((BQ, BT, BG), 0.0, dtype)
    for h0 in range(0, H, BH):
        _, _, _, counts, where, _, s = _scores(h0, t, H, halo_ptr, slot_ptr, row_ptr, q_ok, kz,
                                               q2, M, G, d, HAS_OFFSETS, PRECISION, BQ, BH, BG,
                                               BM, BD)  # fmt: skip
        for r in range(T):
            _rho, x = _row_logits(s, gl0, qt, grho_ptr, qe, rho_ptr, r, where, counts, G, M, c, D,
                               e, HAS_GL, GL_V, HAS_RHO, SINGLE, BG, BM, BC, BE)  # fmt: skip
            new = tl.maximum(_row3(top, r, BT), tl.max(tl.max(x, axis=3), axis=2))  # (BQ, BG)
            safe = tl.where(new == float("-inf"), 0.0, new)
            add = tl.sum(tl.sum(tl.exp(x - safe[:, :, None, None]), axis=3), axis=2)
            grown = _row3(total, r, BT) * tl.exp(_row3(top, r, BT) - safe) + add
            top = tl.where(rr == r, new[:, None, :], top)
            total = tl.where(rr == r, grown[:, None, :], total)
    # 0 for a query with no neighbour (the padding): its weights are 0 anyway
    lse = tl.where(total > 0, top + tl.log(tl.where(total > 0, total, 1.0)), 0.0)
    tl.store(lse_ptr + (zl[:, None, None] * T + rr) * G + g, lse,
             mask=q_ok[:, None, None] & (rr < T) & (g < G))  # fmt: skip

    # 2. out = P Val
    acc = tl.full((BQ * BR, BD), 0.0, dtype)
    for h0 in range(0, H, BH):
        rows, exists, slot, counts, where, _, s = _scores(h0, t, H, halo_ptr, slot_ptr, row_ptr,
                                                          q_ok, kz, q2, M, G, d, HAS_OFFSETS,
                                                          PRECISION, BQ, BH, BG, BM,
                                                          BD)  # fmt: skip
        keep = slot  # a stand-in where nothing is dropped
        if DROP:
            keep = _keep(zl, slot, J, M, G, s0, s1, threshold, BG, BM)
        mixed = _mix(s, gl0, qt, grho_ptr, qe, rho_ptr, lse, keep, where, counts, G, M, c, D, e,
                     T, HAS_GL, GL_V, HAS_RHO, SINGLE, DROP, BQ, BG, BH, BM, BC, BE, BT,
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
    forward's LSE ``(Z, L, T, G)``. Grid: Z NT."""
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
    gl0 = qt  # the group logits when they do not depend on r (a stand-in otherwise)
    if HAS_GL and not GL_V:
        gl0 = _group_logits(qt, grho_ptr, 0, G, M, c, BG, BM, BC)
    rr = tl.arange(0, BT)[None, :, None]
    g = tl.arange(0, BG)[None, None, :]
    # padding rows get +inf: W = 0 there
    lse = tl.load(lse_ptr + (zl[:, None, None] * T + rr) * G + g,
                  mask=q_ok[:, None, None] & (rr < T) & (g < G), other=float("inf"))  # fmt: skip
    ro = tl.arange(0, BR)[None, :, None]
    ch = tl.arange(0, BD)[None, None, :]
    go = tl.load(go_ptr + (zl[:, None, None] * GO + ro) * d + ch,
                 mask=q_ok[:, None, None] & (ro < GO) & (ch < d), other=0.0)  # fmt: skip
    go2 = tl.reshape(go, (BQ * BR, BD))

    # 1. A_r = sum_(h, m) W_r X_r
    big_a = tl.full((BQ, BT, BG), 0.0, dtype)
    for h0 in range(0, H, BH):
        rows, exists, slot, counts, where, _, s = _scores(h0, t, H, halo_ptr, slot_ptr, row_ptr,
                                                          q_ok, kz, q2, M, G, d, HAS_OFFSETS,
                                                          PRECISION, BQ, BH, BG, BM,
                                                          BD)  # fmt: skip
        keep = slot  # a stand-in where nothing is dropped
        if DROP:
            keep = _keep(zl, slot, J, M, G, s0, s1, threshold, BG, BM)
        vals = _values(vz, rows, exists, d, BH, BM, BD)
        dp = _product(go2, vals, PRECISION, BQ, BR, BH, BM)
        for r in range(T):
            _rho, x = _row_logits(s, gl0, qt, grho_ptr, qe, rho_ptr, r, where, counts, G, M, c, D,
                               e, HAS_GL, GL_V, HAS_RHO, SINGLE, BG, BM, BC, BE)  # fmt: skip
            w = tl.exp(x - _row3(lse, r, BT)[:, :, None, None])
            a = tl.sum(tl.sum(w * _kept(_dp_row(dp, r, SINGLE, BR), keep, DROP), axis=3), axis=2)
            big_a = tl.where(rr == r, big_a + a[:, None, :], big_a)

    # 2. gradients
    dq2 = tl.full((BQ * BG, BD), 0.0, dtype)
    dqe = tl.full((BQ, BG, BE), 0.0, dtype)  # the spatial term's part of dq[:, :, :e]
    dgl = tl.full((BQ, BT, BG, BM), 0.0, dtype)  # sum_h dx_r by row r (GL_V)
    dgl0 = tl.full((BQ, BG, BM), 0.0, dtype)  # sum_(r, h) dx_r (not GL_V)
    rt = tl.arange(0, BT)[None, :, None, None]
    ro = tl.arange(0, BR)[None, :, None, None]
    for h0 in range(0, H, BH):
        rows, exists, slot, counts, where, keys, s = _scores(
            h0, t, H, halo_ptr, slot_ptr, row_ptr, q_ok, kz, q2, M, G, d, HAS_OFFSETS, PRECISION,
            BQ, BH, BG, BM, BD,
        )  # fmt: skip
        keep = slot
        if DROP:
            keep = _keep(zl, slot, J, M, G, s0, s1, threshold, BG, BM)
        vals = _values(vz, rows, exists, d, BH, BM, BD)
        dp = _product(go2, vals, PRECISION, BQ, BR, BH, BM)
        mixed = tl.full((BQ, BR, BH, BM), 0.0, dtype)
        ds = tl.full((BQ, BG, BH, BM), 0.0, dtype)  # sum_r dx_r
        for r in range(T):
            table, x = _row_logits(s, gl0, qt, grho_ptr, qe, rho_ptr, r, where, counts, G, M, c,
                                   D, e, HAS_GL, GL_V, HAS_RHO, SINGLE, BG, BM, BC,
                                   BE)  # fmt: skip
            w = tl.exp(x - _row3(lse, r, BT)[:, :, None, None])
            dx = w * (_kept(_dp_row(dp, r, SINGLE, BR), keep, DROP)
                      - _row3(big_a, r, BT)[:, :, None, None])  # fmt: skip
            ds += dx
            if GL_V:
                dgl = tl.where(rt == r, dgl + tl.sum(dx, axis=2)[:, None, :, :], dgl)
            else:
                dgl0 += tl.sum(dx, axis=2)
            if SINGLE:
                mixed = _kept(w, keep, DROP)
            else:
                mixed = tl.where(ro == r, tl.sum(_kept(w, keep, DROP), axis=1)[:, None, :, :],
                                 mixed)  # fmt: skip
            if HAS_RHO:  # drho[r, row] += sum_g dsp q[:, :e]; dq[:, :e] += sum_h dsp rho[r, row]
                dsp = tl.sum(dx, axis=3)  # (BQ, BG, BH)
                ce = tl.arange(0, BE)
                if SINGLE:
                    gg = tl.arange(0, BG)[None, :, None, None]
                    at = (gg * D + where[:, None, :, None]) * e + ce[None, None, None, :]
                    ok = counts[:, None, :, None] & (gg < G) & (ce < e)[None, None, None, :]
                    tl.atomic_add(drho_ptr + at, dsp[:, :, :, None] * qe[:, :, None, :], mask=ok)
                    dqe += tl.sum(dsp[:, :, :, None] * table, axis=2)
                else:
                    part = tl.sum(dsp[:, :, :, None] * qe[:, :, None, :], axis=1)  # (BQ, BH, BE)
                    at = (r * D + where[:, :, None]) * e + ce[None, None, :]
                    ok = counts[:, :, None] & (ce < e)[None, None, :]
                    tl.atomic_add(drho_ptr + at, part, mask=ok)
                    dqe += tl.sum(dsp[:, :, :, None] * table[:, None, :, :], axis=2)
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
        for r in range(T if GL_V else 1):
            dgl_r = dgl0
            if GL_V:
                dgl_r = _row4(dgl, r, BT)  # (BQ, BG, BM)
            at = ((r * G + gm) * M + mm) * c + cc
            enc = tl.load(grho_ptr + at, mask=enc_ok, other=0.0)  # (BG, BM, BC)
            part = tl.sum(dgl_r[:, :, :, None] * qt[:, :, None, :], axis=0)  # (BG, BM, BC)
            size = (T if GL_V else 1) * G * M * c
            tl.store(dgrho_ptr + pid * size + at, part, mask=enc_ok)
            dqt += tl.sum(dgl_r[:, :, :, None] * enc[None, :, :, :], axis=2)
        cc4 = tl.arange(0, BC)[None, None, :, None]
        dq += tl.sum(dqt[:, :, :, None] * (cc4 + d - c == ch[:, :, None, :]), axis=2)
    gq = tl.arange(0, BG)[None, :, None]
    tl.store(dq_ptr + (zl[:, None, None] * G + gq) * d + ch, dq,
             mask=q_ok[:, None, None] & (gq < G) & (ch < d))  # fmt: skip
