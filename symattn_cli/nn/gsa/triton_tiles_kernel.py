"""The fused Triton kernels of the factorised attention core (:mod:`symattn_cli.nn.gsa.core`,
which states the algorithm and the letters) over tiles of queries;
:mod:`symattn_cli.nn.gsa.triton_tiles` builds the tiles and launches them.

A program takes a tile of BQ query points of one batch-head. Its products have one row per
(query iq, outer row r, query element g), NR = BQ BR BG rows (BR of the BT >= T rows r in
the sum form, 1 in the single form; a tile's rows r beyond MAX_ROWS are taken by CHUNKS
programs), and one column per (halo point h, key element m): the tile's
*halo* is the union of its queries' neighbours (``halo (NT, H)``: key points, each repeated
as often as one query lists it), visited BH points at a time. ``slot (NT, BQ, H)`` says
which neighbour j of query iq a halo point is (-1: none: outside its window, invalid, or
padding) and ``row (NT, BQ, H)`` its row of rho (global layers; local ones read row j).

The two softmaxes of the core are one softmax over (h, m) of the whole logit for each row
(i, r, g) (beta_r pi_r = exp(x_r - LSE_r), the core's factorisation read backwards), which
the kernel runs as FlashAttention does, online over the halo, in base 2 (log2(e) x):

  x[(i, r, g), (h, m)] = S + gl[i, r, g, m] + sp[i, r, g, h]     (-inf off the slots)
  S   = Q K^T            (NR, d) @ (d, BH M): q[i, g] on every row r      (``tl.dot``)
  gl  = q[i, g, d-c:] . grho[r, g, m]       (row 0 of grho when the group term does not see v)
  sp  = q[i, g, :e] . rho[r, row]           (single form: rho at row g)
  O   = sum_(h, m) exp(x - LSE) keep val    (NR, BH M) @ (BH M, d)                (``tl.dot``)
  out[i, r] = sum_g O[(i, r, g)]            (single form: out[i, g] = O[(i, 0, g)])

T = V rows r with a spatial term or a group term that depends on v, else 1; the single
form (g = v) has one. The keys, values and dropout's keep mask of a block serve every row;
the sums that link rows (over g and r) and columns (over h, m) happen inside the matrix
products or once a tile, not per block across lanes. Dropout's keep mask is that of pi,
drawn once per call by :func:`keep_bits` (the mask of common.keep_mask, one bit per m). A
local spatial term with more products than the logits (e > M: lifting layers, SP_DOT) is
formed once a tile for every neighbour j and reaches a block through its one-hot map of
neighbours (a product); otherwise rho is gathered at each block's offsets.

  forward   O per row (Z, L, T, G, d), out and LSE (Z, L, T, G), one tile a program
  backward  with W = exp(x - LSE), GO[(i, r, g)] = dL/dout[i, r] (single: [i, g]),
            dP = keep GO Val^T and A = GO . O per row (from the forward's O, as
            FlashAttention-2 keeps its D = rowsum(dO O)), in one pass over the halo:
            dx = W (dP - A): dq = sum_r dx K, dK = dx^T Q, dVal = (W keep)^T GO,
            d gl = sum_h dx, d sp = sum_m dx: d grho and dq's group part from d gl,
            drho and dq's spatial part from d sp. Where a tile has rows r (BR > 1: the sum
            form with T > 1), which share q, dx is summed over r first and dq, dK come from
            its BQ BG rows; and as its rows g share GO, W keep is summed over g first for
            dVal (those three products as multiply-adds, not ``tl.dot``).

A backward program takes tiles pid, pid + programs, ...: dK and dVal are added to dk, dv once
per (tile, block) (atomic adds of the block's sum), d grho is summed per program into its
own row of ``dgrho (programs, Vg, G, M, c)``, which the caller reduces in a fixed order, and
drho is added into copy pid mod COPIES of it (the caller sums the copies); dq is stored, or
added where a tile's rows r are split over programs. On a GPU the atomic adds make dk, dv,
drho (and then dq) vary at round-off level from run to run. Accumulation is in the inputs'
dtype: float32 products on tensor cores at float32 accuracy (three TF32 products,
:func:`_dot`), float64 ones on CUDA cores.

Shapes: q ``(Z, L, G, d)``, k, v ``(Z, Lkv, M, d)``, grho ``(Vg, G, M, c)``, rho ``(V, D,
e)``, out ``(Z, L, V, d)``, the rows' O ``(Z, L, T, G, d)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from symattn_cli.nn.gsa.triton_kernel import _keep as _hash_keep

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _split(x, PRECISION: tl.constexpr):
    """x as hi + lo for :func:`_dot`: hi its top 19 bits (a TF32 number), lo the rest, exact;
    float64 (``ieee``): x itself."""
    if PRECISION == "ieee":
        hi = x
        lo = x
    else:
        hi = (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        lo = x - hi
    return hi, lo


@triton.jit
def _dot(a_hi, a_lo, b_hi, b_lo, PRECISION: tl.constexpr):
    """a b from the operands' :func:`_split`: in float32 three TF32 tensor-core products,
    hi hi + hi lo + lo hi (lo lo is below float32's rounding), each operand split once for all
    the products it enters; float64 one exact product."""
    if PRECISION == "ieee":  # on CUDA cores: Triton's float64 tensor-core products take K <= 4
        out = tl.sum(a_hi[:, :, None] * b_hi[None, :, :], axis=1)
    else:
        out = tl.dot(a_lo, b_hi, input_precision="tf32", out_dtype=tl.float32)
        out = tl.dot(a_hi, b_lo, out, input_precision="tf32", out_dtype=tl.float32)
        out = tl.dot(a_hi, b_hi, out, input_precision="tf32", out_dtype=tl.float32)
    return out


@triton.jit
def _joined(hi, lo, PRECISION: tl.constexpr):
    """x from its :func:`_split`."""
    if PRECISION == "ieee":
        out = hi
    else:
        out = hi + lo
    return out


@triton.jit
def _dot_by(a_hi, a_lo, b, PRECISION: tl.constexpr):
    """a b for b exact in TF32 (0 or 1): two products in float32, one in float64."""
    if PRECISION == "ieee":
        out = tl.sum(a_hi[:, :, None] * b[None, :, :], axis=1)
    else:
        out = tl.dot(a_lo, b, input_precision="tf32", out_dtype=tl.float32)
        out = tl.dot(a_hi, b, out, input_precision="tf32", out_dtype=tl.float32)
    return out


# The seed changes with every call: no variant compiled for one that is 1 or a multiple of 16.
@triton.jit(do_not_specialize=["s0", "s1", "threshold"])
def keep_bits(bits_ptr, J, M, G, s0, s1, threshold, BJ: tl.constexpr, BM: tl.constexpr,
              BG: tl.constexpr):  # fmt: skip
    """Dropout's keep mask of query zl = program id, ``bits (Z L, G, J)``: bit m of [zl, g, j]
    set where entry (zl, j, m, g) is kept (the one-query kernel's hash, as common.keep_mask)."""
    zl = tl.program_id(0).to(tl.int64)
    m = tl.arange(0, BM)[None, :, None]
    for j0 in range(0, J, BJ):
        j = j0 + tl.arange(0, BJ)
        kept = _hash_keep(zl, j, J, M, G, s0.to(tl.uint32), s1.to(tl.uint32), threshold, BM, BG)
        bits = tl.sum(tl.where(kept & (m < M), 1 << m, 0), axis=1)  # (BJ, BG)
        gg = tl.arange(0, BG)[None, :]
        tl.store(bits_ptr + (zl * G + gg) * J + j[:, None], bits.to(bits_ptr.dtype.element_ty),
                 mask=(j[:, None] < J) & (gg < G))  # fmt: skip


@triton.jit
def _rows(t, r0, L, T, G, BQ: tl.constexpr, BR: tl.constexpr, BG: tl.constexpr):
    """The rows of tile t ``(NR,)``: query iq, outer row r, element g, the query point i and
    whether the row counts."""
    row = tl.arange(0, BQ * BR * BG)
    iq = row // (BR * BG)
    r = r0 + (row // BG) % BR
    g = row % BG
    i = t * BQ + iq
    return iq, r, g, i, (i < L) & (r < T) & (g < G)


@triton.jit
def _queries(q_ptr, zl, g, live, G, d, e, BD: tl.constexpr, BE: tl.constexpr):
    """q[i, g] of each row ``(NR, BD)`` and its first e channels ``(NR, BE)``."""
    base = q_ptr + (zl * G + g)[:, None] * d
    ch = tl.arange(0, BD)[None, :]
    q = tl.load(base + ch, mask=live[:, None] & (ch < d), other=0.0)
    ce = tl.arange(0, BE)[None, :]
    qe = tl.load(base + ce, mask=live[:, None] & (ce < e), other=0.0)
    return q, qe


@triton.jit
def _group_logits(q_ptr, grho_ptr, zl, gr, g, live, G, M, d, c, BM: tl.constexpr,
                  BC: tl.constexpr):  # fmt: skip
    """gl[row, m] = q[i, g, d-c:] . grho[gr, g, m] ``(NR, BM)``, for each row's encoding row gr
    and element g, one channel at a time."""
    m = tl.arange(0, BM)[None, :]
    at = ((gr * G + g)[:, None] * M + m) * c
    ok = live[:, None] & (m < M)
    gl = tl.zeros((zl.shape[0], BM), q_ptr.dtype.element_ty)
    for cc in tl.static_range(BC):
        if cc < c:
            tail = tl.load(q_ptr + (zl * G + g) * d + d - c + cc, mask=live, other=0.0)
            gl += tail[:, None] * tl.load(grho_ptr + at + cc, mask=ok, other=0.0)
    return gl


@triton.jit
def _block(h0, tq, H, halo_ptr, slot_ptr, row_ptr, live, kz, M, d, HAS_OFFSETS: tl.constexpr,
           BH: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """Halo points h0 .. h0 + BH of the tile whose queries are ``tq`` ``(NR,)``: the rows of k
    and v at their elements ``(BH, BM)`` and which exist, each row's neighbour slot ``(NR,
    BH)`` (-1: none), whether it counts, where its spatial term reads rho, and the keys
    ``(BH BM, BD)``."""
    h = h0 + tl.arange(0, BH)
    point = tl.load(halo_ptr + h)  # (BH,), -1: padding
    m = tl.arange(0, BM)
    rows = point[:, None] * M + m[None, :]  # (BH, BM)
    exists = (point >= 0)[:, None] & (m < M)[None, :]
    at = tq[:, None] * H + h[None, :]  # (NR, BH)
    slot = tl.load(slot_ptr + at)
    counts = (slot >= 0) & live[:, None]
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
def _load_rows(ptr, at, ok, d, BD: tl.constexpr):
    """Rows at[n] of a ``(rows, d)`` tensor ``(N, BD)``; 0 where not ok and past d."""
    ch = tl.arange(0, BD)[None, :]
    return tl.load(ptr + at[:, None] * d + ch, mask=ok[:, None] & (ch < d), other=0.0)


@triton.jit
def _keep(bits_ptr, zl, g, slot, counts, G, J, BM: tl.constexpr):
    """Each row's keep mask at the block's slots ``(NR, BH, BM)`` from :func:`keep_bits`."""
    bits = tl.load(bits_ptr + (zl * G + g)[:, None] * J + slot, mask=counts, other=0)
    m = tl.arange(0, BM)[None, None, :]
    return ((bits.to(tl.int32)[:, :, None] >> m) & 1) != 0


@triton.jit
def _spatial(h0, t, r0, H, slot_ptr, row_ptr, rho_ptr, qe, rv, where, counts, L, T, D, e,
             HAS_OFFSETS: tl.constexpr, SINGLE: tl.constexpr, BQ: tl.constexpr,
             BR: tl.constexpr, BG: tl.constexpr, BH: tl.constexpr, BE: tl.constexpr):  # fmt: skip
    """rho at the block's offsets, the places it was read from and which count, and the
    spatial logits qe . rho ``(NR, BH)``. The single form reads a table row per row (rho at
    row g, ``(NR, BH, BE)``); the sum form one per query and row r, shared by the rows' g
    (``(BQ BR, BH, BE)``)."""
    ce = tl.arange(0, BE)[None, None, :]
    if SINGLE:
        at = (rv[:, None, None] * D + where[:, :, None]) * e + ce
        ok = counts[:, :, None] & (ce < e)
        table = tl.load(rho_ptr + at, mask=ok, other=0.0)
        sp = tl.sum(qe[:, None, :] * table, axis=2)
    else:
        qr = tl.arange(0, BQ * BR)
        i = t * BQ + qr // BR
        r = r0 + qr % BR
        place = i[:, None] * H + (h0 + tl.arange(0, BH))[None, :]
        slot = tl.load(slot_ptr + place)
        counts = (slot >= 0) & ((i < L) & (r < T))[:, None]
        if HAS_OFFSETS:
            where = tl.load(row_ptr + place, mask=counts, other=0)
        else:
            where = slot
        at = (r[:, None, None] * D + where[:, :, None]) * e + ce
        ok = counts[:, :, None] & (ce < e)
        table = tl.load(rho_ptr + at, mask=ok, other=0.0)  # (BQ BR, BH, BE)
        qe = tl.reshape(qe, (BQ * BR, BG, BE))
        sp = tl.reshape(tl.sum(qe[:, :, None, :] * table[:, None, :, :], axis=3),
                        (BQ * BR * BG, BH))  # fmt: skip
    return table, at, ok, sp


@triton.jit
def _rho_row(rho_ptr, vr, V, D, e, J, BE: tl.constexpr, BJ: tl.constexpr):
    """Row vr of a local table rho ``(V, J, e)`` as ``(e, j)``: ``(BE, BJ)``."""
    ce = tl.arange(0, BE)[:, None]
    j = tl.arange(0, BJ)[None, :]
    return tl.load(rho_ptr + (vr * D + j) * e + ce, mask=(vr < V) & (ce < e) & (j < J), other=0.0)


@triton.jit
def _local_logits(qe, rho_ptr, rv, e, V, D, J, PRECISION: tl.constexpr, NR: tl.constexpr,
                  BE: tl.constexpr, BJ: tl.constexpr):  # fmt: skip
    """A local spatial term's logits of the tile, once: log2(e) q[:, :e] . rho[rv, j] for every
    row and neighbour j ``(NR, BJ)``, split (:func:`_split`); ``qe`` the rows' first e
    channels ``(NR, BE)``, one product per row of rho. A block's part is then this times the
    one-hot map of the row's query (:func:`_one_hot`)."""
    a_hi, a_lo = _split(qe, PRECISION)
    sp = tl.zeros((NR, BJ), qe.dtype)
    for vr in range(V):
        b_hi, b_lo = _split(_rho_row(rho_ptr, vr, V, D, e, J, BE, BJ), PRECISION)
        sp += tl.where((rv == vr)[:, None], _dot(a_hi, a_lo, b_hi, b_lo, PRECISION), 0.0)
    return _split(sp * LOG2E, PRECISION)


@triton.jit
def _one_hot(h0, query, H, slot_ptr, BJ: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr,
             dtype: tl.constexpr):  # fmt: skip
    """Which neighbour j of the tile's query ``query`` each column (h, m) of a block is: ``(j,
    (h, m))``, 1 or 0, ``(BJ, BH BM)``."""
    slot = tl.load(slot_ptr + query * H + h0 + tl.arange(0, BH * BM) // BM)  # per column
    return tl.where(slot[None, :] == tl.arange(0, BJ)[:, None], 1.0, 0.0).to(dtype)


@triton.jit
def _logits(h0, t, r0, tq, H, halo_ptr, slot_ptr, row_ptr, live, kz, q_hi, q_lo, bias, qe, sp_hi,
            sp_lo, rho_ptr, rv, L, T, M, d, D, e, HAS_OFFSETS: tl.constexpr,
            HAS_RHO: tl.constexpr, SP_DOT: tl.constexpr, SINGLE: tl.constexpr,
            PRECISION: tl.constexpr, BQ: tl.constexpr, BR: tl.constexpr, BG: tl.constexpr,
            BH: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
            BJ: tl.constexpr):  # fmt: skip
    """A halo block (:func:`_block`, its keys split by :func:`_split`), its spatial table
    (:func:`_spatial`; stand-ins without a spatial term) and the logits in base 2, log2(e) x
    ``(NR, BH BM)``: ``bias`` ``(NR, BM)`` holds log2(e) gl and -inf past M, ``qe`` the
    queries' first e channels times log2(e), q ``(hi, lo)``; -inf off the slots. With SP_DOT
    the spatial term comes from the tile's ``sp`` (:func:`_local_logits`) through the one-hot
    map of each row's query; else from rho at the block's offsets."""
    rows, exists, slot, counts, where, keys = _block(
        h0, tq, H, halo_ptr, slot_ptr, row_ptr, live, kz, M, d, HAS_OFFSETS, BH, BM, BD
    )
    k_hi, k_lo = _split(keys, PRECISION)
    s = _dot(q_hi, q_lo, tl.trans(k_hi), tl.trans(k_lo), PRECISION)
    table = where
    at = where
    ok = counts
    if HAS_RHO and not SP_DOT:
        table, at, ok, sp = _spatial(h0, t, r0, H, slot_ptr, row_ptr, rho_ptr, qe, rv, where,
                                     counts, L, T, D, e, HAS_OFFSETS, SINGLE, BQ, BR, BG, BH,
                                     BE)  # fmt: skip
        column = tl.where(counts, sp, float("-inf"))
    else:
        column = tl.where(counts, 0.0, float("-inf")).to(s.dtype)
    x = tl.reshape(s, (BQ * BR * BG, BH, BM)) * LOG2E + bias[:, None, :] + column[:, :, None]
    x = tl.reshape(x, (BQ * BR * BG, BH * BM))
    if SP_DOT:
        for qq in tl.static_range(BQ):  # each query's rows through its own map
            one_hot = _one_hot(h0, t * BQ + qq, H, slot_ptr, BJ, BH, BM, s.dtype)
            part = _dot_by(sp_hi, sp_lo, one_hot, PRECISION)
            x += tl.where((tq == t * BQ + qq)[:, None], part, 0.0)
    return rows, exists, slot, counts, k_hi, k_lo, table, at, ok, x


@triton.jit
def _tile_rows(q_ptr, grho_ptr, rho_ptr, t, r0, z, L, T, G, M, d, c, e, V, D, J,
               HAS_GL: tl.constexpr, GL_V: tl.constexpr, SP_DOT: tl.constexpr,
               SINGLE: tl.constexpr, PRECISION: tl.constexpr, BQ: tl.constexpr,
               BR: tl.constexpr, BG: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
               BC: tl.constexpr, BE: tl.constexpr,
               BJ: tl.constexpr):  # fmt: skip
    """Tile t's rows (:func:`_rows`) and what both kernels hold through the halo loop: zl = z L
    + i, the halo row of each, which count, r, g, each row's row of rho (r; single form: g) and
    of the group encoding, q ``(NR, BD)`` split (:func:`_split`), its first e channels ``(NR,
    BE)`` and the same times log2(e), the logits' row bias ``(NR, BM)`` (log2(e) gl, -inf past
    M) and with SP_DOT the tile's spatial logits (:func:`_local_logits`; stand-ins else)."""
    iq, r, g, i, live = _rows(t, r0, L, T, G, BQ, BR, BG)
    zl = z * L + i.to(tl.int64)
    q, qe = _queries(q_ptr, zl, g, live, G, d, e, BD, BE)
    gr = r * 0  # each row's row of the group encoding
    if GL_V:
        gr = r
    rv = r
    if SINGLE:
        rv = g
    m = tl.arange(0, BM)[None, :]
    bias = tl.zeros((BQ * BR * BG, BM), q.dtype)
    if HAS_GL:
        gl = _group_logits(q_ptr, grho_ptr, zl, gr, g, live, G, M, d, c, BM, BC)
        bias = gl * LOG2E
    bias = tl.where(m < M, bias, float("-inf"))
    q_hi, q_lo = _split(q, PRECISION)
    sp_hi = q_hi  # stand-ins without a local spatial term
    sp_lo = q_lo
    if SP_DOT:
        sp_hi, sp_lo = _local_logits(qe, rho_ptr, rv, e, V, D, J, PRECISION, BQ * BR * BG, BE,
                                     BJ)  # fmt: skip
    tq = t * BQ + iq
    return zl, tq, iq, live, r, g, rv, gr, q_hi, q_lo, qe, qe * LOG2E, bias, sp_hi, sp_lo


@triton.jit
def attention_forward(
    out_ptr, lse_ptr, rows_ptr, q_ptr, k_ptr, v_ptr, grho_ptr, rho_ptr, bits_ptr, halo_ptr,
    slot_ptr, row_ptr, L, Lkv, NT, H, J, M, G, d, c, e, D, V, T,
    HAS_GL: tl.constexpr, GL_V: tl.constexpr, HAS_RHO: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, SP_DOT: tl.constexpr, SINGLE: tl.constexpr, DROP: tl.constexpr,
    BQ: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr, BG: tl.constexpr, BM: tl.constexpr,
    BD: tl.constexpr, BC: tl.constexpr, BE: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    CHUNKS: tl.constexpr, BJ: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The rows' outputs O ``(Z, L, T, G, d)``, out ``(Z, L, V, d)`` (the single form: O
    itself, not written) and the log-sum-exp LSE ``(Z, L, T, G)``, one tile of BQ queries a
    program (grid: Z NT); ``bits`` from :func:`keep_bits` where DROP."""
    NR: tl.constexpr = BQ * BR * BG
    pid = tl.program_id(0).to(tl.int64)
    r0 = (pid % CHUNKS) * BR  # the program's rows r: r0 .. r0 + BR
    z = pid // CHUNKS // NT
    t = pid // CHUNKS % NT
    zl, tq, _iq, live, r, g, rv, _gr, q_hi, q_lo, _qe, qe2, bias, sp_hi, sp_lo = _tile_rows(
        q_ptr, grho_ptr, rho_ptr, t, r0, z, L, T, G, M, d, c, e, V, D, J, HAS_GL, GL_V, SP_DOT,
        SINGLE, PRECISION, BQ, BR, BG, BM, BD, BC, BE, BJ,
    )  # fmt: skip
    kz = k_ptr + z * Lkv * M * d
    vz = v_ptr + z * Lkv * M * d
    halo = halo_ptr + t * H
    dtype = q_hi.dtype

    top = tl.full((NR,), float("-inf"), dtype)  # in base 2, as the logits
    total = tl.zeros((NR,), dtype)
    acc = tl.zeros((NR, BD), dtype)
    for h0 in range(0, H, BH):
        rows, exists, slot, counts, _kh, _kl, _t, _a, _o, x = _logits(
            h0, t, r0, tq, H, halo, slot_ptr, row_ptr, live, kz, q_hi, q_lo, bias, qe2, sp_hi,
            sp_lo, rho_ptr, rv, L, T, M, d, D, e, HAS_OFFSETS, HAS_RHO, SP_DOT, SINGLE, PRECISION,
            BQ, BR, BG, BH, BM, BD, BE, BJ,
        )  # fmt: skip
        new = tl.maximum(top, tl.max(x, axis=1))
        safe = tl.where(new == float("-inf"), 0.0, new)
        p = tl.math.exp2(x - safe[:, None])
        scale = tl.math.exp2(top - safe)
        total = total * scale + tl.sum(p, axis=1)
        if DROP:
            keep = _keep(bits_ptr, zl, g, slot, counts, G, J, BM)
            p = tl.where(tl.reshape(keep, (NR, BH * BM)), p, 0.0)
        p_hi, p_lo = _split(p, PRECISION)
        v_hi, v_lo = _split(_values(vz, rows, exists, d, BH, BM, BD), PRECISION)
        acc = acc * scale[:, None] + _dot(p_hi, p_lo, v_hi, v_lo, PRECISION)
        top = new
    # 0 for a row with no neighbour (the padding): its weights are 0 anyway
    some = total > 0
    lse = tl.where(some, (top + tl.log2(tl.where(some, total, 1.0))) * LN2, 0.0)
    tl.store(lse_ptr + (zl * T + r) * G + g, lse, mask=live)
    o = acc / tl.where(some, total, 1.0)[:, None]  # (NR, BD)
    ch = tl.arange(0, BD)[None, :]
    tl.store(rows_ptr + ((zl * T + r) * G + g)[:, None] * d + ch, o, mask=live[:, None] & (ch < d))
    if not SINGLE:  # (single: row (i, 0, g) is output g)
        o = tl.sum(tl.reshape(o, (BQ * BR, BG, BD)), axis=1)  # rows (i, r)
        io = tl.arange(0, BQ * BR) // BR
        ro = r0 + tl.arange(0, BQ * BR) % BR
        zo = z * L + (t * BQ + io).to(tl.int64)
        ok = (t * BQ + io < L) & (ro < T)
        if BT == 1:  # no term sees v: every v has this row
            vv = tl.arange(0, BV)[None, :, None]
            tl.store(out_ptr + (zo[:, None, None] * V + vv) * d + ch[:, None, :],
                     tl.broadcast_to(o[:, None, :], (BQ, BV, BD)),
                     mask=ok[:, None, None] & (vv < V) & (ch[:, None, :] < d))  # fmt: skip
        else:
            tl.store(out_ptr + (zo * V + ro)[:, None] * d + ch, o, mask=ok[:, None] & (ch < d))


@triton.jit
def _weights(h0, t, r0, tq, H, halo_ptr, slot_ptr, row_ptr, bits_ptr, live, kz, vz, zl, g, lse,
             q_hi, q_lo, bias, qe, sp_hi, sp_lo, rho_ptr, rv, L, T, M, G, J, d, D, e,
             HAS_OFFSETS: tl.constexpr, HAS_RHO: tl.constexpr, SP_DOT: tl.constexpr,
             SINGLE: tl.constexpr, DROP: tl.constexpr, PRECISION: tl.constexpr,
             BQ: tl.constexpr, BR: tl.constexpr, BG: tl.constexpr, BH: tl.constexpr,
             BM: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BJ: tl.constexpr):  # fmt: skip
    """A halo block of the backward (:func:`_logits`, from the forward's ``lse`` in base 2):
    W = exp(x - LSE) and W keep ``(NR, BH BM)``, and the block's values split
    (:func:`_split`)."""
    rows, exists, slot, counts, k_hi, k_lo, table, at, ok, x = _logits(
        h0, t, r0, tq, H, halo_ptr, slot_ptr, row_ptr, live, kz, q_hi, q_lo, bias, qe, sp_hi,
        sp_lo, rho_ptr, rv, L, T, M, d, D, e, HAS_OFFSETS, HAS_RHO, SP_DOT, SINGLE, PRECISION,
        BQ, BR, BG, BH, BM, BD, BE, BJ,
    )  # fmt: skip
    w = tl.math.exp2(x - lse[:, None])
    wk = w
    if DROP:
        keep = _keep(bits_ptr, zl, g, slot, counts, G, J, BM)
        wk = tl.where(tl.reshape(keep, (BQ * BR * BG, BH * BM)), w, 0.0)
    v_hi, v_lo = _split(_values(vz, rows, exists, d, BH, BM, BD), PRECISION)
    return rows, exists, counts, k_hi, k_lo, table, at, ok, w, wk, v_hi, v_lo


@triton.jit
def attention_backward(
    dq_ptr, dk_ptr, dv_ptr, dgrho_ptr, drho_ptr, go_ptr, lse_ptr, rows_ptr,
    q_ptr, k_ptr, v_ptr, grho_ptr, rho_ptr, bits_ptr, halo_ptr, slot_ptr, row_ptr,
    L, Lkv, NT, H, J, M, G, d, c, e, D, V, T, GO, COPIES, TILES,
    HAS_GL: tl.constexpr, GL_V: tl.constexpr, HAS_RHO: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, SP_DOT: tl.constexpr, SINGLE: tl.constexpr, DROP: tl.constexpr,
    BQ: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr, BG: tl.constexpr, BM: tl.constexpr,
    BD: tl.constexpr, BC: tl.constexpr, BE: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    CHUNKS: tl.constexpr, BJ: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dq ``(Z, L, G, d)`` and this program's d grho ``(Vg, G, M, c)`` (row ``pid`` of
    ``dgrho``) written; dk, dv ``(Z, Lkv, M, d)`` and drho ``(COPIES, V, D, e)`` added to
    (zeroed by the caller; program p adds to copy p mod COPIES); from go = dL/dout ``(Z, L,
    GO, d)`` (GO = 1 where every v has the same output row: their gradients summed), the
    forward's LSE ``(Z, L, T, G)`` and its rows' outputs O ``(Z, L, T, G, d)``. Program p
    takes tiles p, p + programs, ... of the Z NT = TILES."""
    NR: tl.constexpr = BQ * BR * BG
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    drho_ptr += (pid % COPIES) * V * D * e
    ch = tl.arange(0, BD)[None, :]
    Vg = 1
    if GL_V:
        Vg = T
    mine = dgrho_ptr + pid.to(tl.int64) * (Vg * G * M * c)  # this program's d grho
    for tile in range(pid, TILES, programs):
        r0 = (tile % CHUNKS) * BR  # the tile's rows r: r0 .. r0 + BR
        z = tile // CHUNKS // NT
        t = tile // CHUNKS % NT
        zl, tq, iq, live, r, g, rv, gr, q_hi, q_lo, qe, qe2, bias, sp_hi, sp_lo = _tile_rows(
            q_ptr, grho_ptr, rho_ptr, t, r0, z, L, T, G, M, d, c, e, V, D, J, HAS_GL, GL_V,
            SP_DOT, SINGLE, PRECISION, BQ, BR, BG, BM, BD, BC, BE, BJ,
        )  # fmt: skip
        dtype = q_hi.dtype
        kz = k_ptr + z * Lkv * M * d
        vz = v_ptr + z * Lkv * M * d
        dkz = dk_ptr + z * Lkv * M * d
        dvz = dv_ptr + z * Lkv * M * d
        halo = halo_ptr + t * H
        # in base 2; padding rows get +inf: W = 0 there
        lse = tl.load(lse_ptr + (zl * T + r) * G + g, mask=live, other=float("inf")) * LOG2E
        go = _load_rows(go_ptr, zl * GO + rv, live, d, BD)
        go_hi, go_lo = _split(go, PRECISION)
        # once per (query, g), which the rows r share: q; per (query, r), which the sum form's
        # rows g share: the output gradient
        qg = tl.arange(0, BQ * BG)
        i_g = t * BQ + qg // BG
        q_g = _load_rows(q_ptr, (z * L + i_g.to(tl.int64)) * G + qg % BG,
                         (i_g < L) & (qg % BG < G), d, BD)  # fmt: skip
        qr = tl.arange(0, BQ * BR)
        i_r = t * BQ + qr // BR
        go_r = _load_rows(go_ptr, (z * L + i_r.to(tl.int64)) * GO + r0 + qr % BR,
                          (i_r < L) & (r0 + qr % BR < T), d, BD)  # fmt: skip

        # A = GO . O per row, from the forward's O
        o = _load_rows(rows_ptr, (zl * T + r) * G + g, live, d, BD)
        big_a = tl.sum(o * go, axis=1)

        # the gradients, one pass over the halo
        dq = tl.zeros((NR, BD), dtype)  # per row: sum_h dx K (BR = 1), the group part
        dq_g = tl.zeros((BQ * BG, BD), dtype)  # per (query, g): sum_(h, r) dx K (BR > 1)
        dgl = tl.zeros((NR, BM), dtype)  # sum_h dx
        dqe = tl.zeros((NR, BE), dtype)  # sum_h dsp rho
        dsp_j = tl.zeros((NR, BJ), dtype)  # a local term's d sp by neighbour j
        for h0 in range(0, H, BH):
            rows, exists, counts, k_hi, k_lo, table, at, ok, w, wk, v_hi, v_lo = _weights(
                h0, t, r0, tq, H, halo, slot_ptr, row_ptr, bits_ptr, live, kz, vz, zl, g, lse, q_hi,
                q_lo, bias, qe2, sp_hi, sp_lo, rho_ptr, rv, L, T, M, G, J, d, D, e, HAS_OFFSETS,
                HAS_RHO, SP_DOT, SINGLE, DROP, PRECISION, BQ, BR, BG, BH, BM, BD, BE, BJ,
            )  # fmt: skip
            dp = _dot(go_hi, go_lo, tl.trans(v_hi), tl.trans(v_lo), PRECISION)
            dx = wk * dp - w * big_a[:, None]
            if BR == 1 or SP_DOT:
                dx_hi, dx_lo = _split(dx, PRECISION)
            if BR == 1:
                dq += _dot(dx_hi, dx_lo, k_hi, k_lo, PRECISION)
                dkeys = _dot(tl.trans(dx_hi), tl.trans(dx_lo), q_hi, q_lo, PRECISION)
            else:  # q is the same for every r: sum dx over r first (BQ BG rows, not NR)
                dxr = tl.reshape(tl.sum(tl.reshape(dx, (BQ, BR, BG, BH * BM)), axis=1),
                                 (BQ * BG, BH * BM))  # fmt: skip
                keys = _joined(k_hi, k_lo, PRECISION)
                dq_g += tl.sum(dxr[:, :, None] * keys[None, :, :], axis=1)
                dkeys = tl.sum(dxr[:, :, None] * q_g[:, None, :], axis=0)
            if BR == 1 or BG == 1:
                wk_hi, wk_lo = _split(wk, PRECISION)
                dvals = _dot(tl.trans(wk_hi), tl.trans(wk_lo), go_hi, go_lo, PRECISION)
            else:  # the sum form's rows g share GO: dVal = sum_(i, r) (sum_g W keep) go[i, r]
                wkg = tl.sum(tl.reshape(wk, (BQ * BR, BG, BH * BM)), axis=1)
                dvals = tl.sum(wkg[:, :, None] * go_r[:, None, :], axis=0)
            chk = tl.arange(0, BD)[None, None, :]
            kv_at = rows[:, :, None] * d + chk
            kv_ok = exists[:, :, None] & (chk < d)
            tl.atomic_add(dvz + kv_at, tl.reshape(dvals, (BH, BM, BD)), mask=kv_ok)
            tl.atomic_add(dkz + kv_at, tl.reshape(dkeys, (BH, BM, BD)), mask=kv_ok)
            dx = tl.reshape(dx, (NR, BH, BM))
            dgl += tl.sum(dx, axis=1)
            if SP_DOT:  # d sp summed over m and placed by j
                for qq in tl.static_range(BQ):  # each query's rows through its own map
                    one_hot = _one_hot(h0, t * BQ + qq, H, slot_ptr, BJ, BH, BM, dtype)
                    part = _dot_by(dx_hi, dx_lo, tl.trans(one_hot), PRECISION)
                    dsp_j += tl.where((iq == qq)[:, None], part, 0.0)
            if HAS_RHO and not SP_DOT:  # drho[rv, row] += sum_g dsp q[:, :e]; dqe += dsp rho
                dsp = tl.sum(dx, axis=2)  # (NR, BH)
                if SINGLE:
                    tl.atomic_add(drho_ptr + at, dsp[:, :, None] * qe[:, None, :], mask=ok)
                    dqe += tl.sum(dsp[:, :, None] * table, axis=1)
                else:  # the rows (i, r, g) of one (i, r) share their table row: sum over g
                    dsp = tl.reshape(dsp, (BQ * BR, BG, BH))
                    qe3 = tl.reshape(qe, (BQ * BR, BG, BE))
                    tl.atomic_add(drho_ptr + at,
                                  tl.sum(dsp[:, :, :, None] * qe3[:, :, None, :], axis=1),
                                  mask=ok)  # fmt: skip
                    dqe += tl.reshape(tl.sum(dsp[:, :, :, None] * table[:, None, :, :], axis=2),
                                      (NR, BE))  # fmt: skip

        if SP_DOT:  # drho[v, j] += sum_rows dsp q[:, :e]; dqe += dsp rho; a row of rho a time
            d_hi, d_lo = _split(dsp_j, PRECISION)
            ce = tl.arange(0, BE)[:, None]
            j = tl.arange(0, BJ)[None, :]
            for vr in range(V):
                own = (rv == vr)[:, None]
                a_hi, a_lo = _split(tl.where(own, qe, 0.0), PRECISION)
                tl.atomic_add(drho_ptr + (vr * D + j) * e + ce,
                              _dot(tl.trans(a_hi), tl.trans(a_lo), d_hi, d_lo, PRECISION),
                              mask=(vr < V) & (ce < e) & (j < J))  # fmt: skip
                b_hi, b_lo = _split(_rho_row(rho_ptr, vr, V, D, e, J, BE, BJ), PRECISION)
                full = _dot(d_hi, d_lo, tl.trans(b_hi), tl.trans(b_lo), PRECISION)  # (NR, BE)
                dqe += tl.where(own, full, 0.0)

        # the group term: d grho[gr, g, m] += sum_i dgl q[:, d-c:]; dq[:, d-c:] += dgl grho
        if HAS_GL:  # one channel cc at a time; d grho added to this program's own row
            m2 = tl.arange(0, BM)[None, :]
            at = ((gr * G + g)[:, None] * M + m2) * c
            ok = live[:, None] & (m2 < M)
            for cc in tl.static_range(BC):
                if cc < c:
                    tail = tl.load(q_ptr + (zl * G + g) * d + d - c + cc, mask=live, other=0.0)
                    enc = tl.load(grho_ptr + at + cc, mask=ok, other=0.0)
                    dq += tl.where(ch == d - c + cc, tl.sum(dgl * enc, axis=1)[:, None], 0.0)
                    part = dgl * tail[:, None]  # (NR, BM); rows that share (gr, g) summed
                    if GL_V:  # the rows (iq, r, g) of one (r, g)
                        part = tl.sum(tl.reshape(part, (BQ, BR * BG, BM)), axis=0)
                        rg = tl.arange(0, BR * BG)[:, None]
                        place = (((r0 + rg // BG) * G + rg % BG) * M + m2) * c + cc
                        keep = (r0 + rg // BG < T) & (rg % BG < G) & (m2 < M)
                    else:  # the rows (iq, r, g) of one g
                        part = tl.sum(tl.reshape(part, (BQ * BR, BG, BM)), axis=0)
                        gg = tl.arange(0, BG)[:, None]
                        place = (gg * M + m2) * c + cc
                        keep = (gg < G) & (m2 < M)
                    tl.store(mine + place, tl.load(mine + place, mask=keep, other=0.0) + part,
                             mask=keep)  # fmt: skip
        # dq of each row (the content part, the group part on the last c channels) summed
        # over r, then the spatial part summed over r on the first e channels
        dq = tl.sum(tl.reshape(dq, (BQ, BR, BG, BD)), axis=1) + tl.reshape(dq_g, (BQ, BG, BD))
        if HAS_RHO:
            dqe = tl.reshape(tl.sum(tl.reshape(dqe, (BQ, BR, BG, BE)), axis=1), (BQ * BG, BE))
            ce = tl.arange(0, BE)[None, :, None]
            dqe = tl.sum(dqe[:, :, None] * (ce == ch[:, None, :]), axis=1)  # (BQ BG, BD)
            dq += tl.reshape(dqe, (BQ, BG, BD))
        i3 = t * BQ + tl.arange(0, BQ)[:, None, None]
        g3 = tl.arange(0, BG)[None, :, None]
        at = dq_ptr + ((z * L + i3.to(tl.int64)) * G + g3) * d + ch[:, None, :]
        ok = (i3 < L) & (g3 < G) & (ch[:, None, :] < d)
        if CHUNKS == 1:
            tl.store(at, dq, mask=ok)
        else:  # each chunk of rows r adds its part
            tl.atomic_add(at, dq, mask=ok)
