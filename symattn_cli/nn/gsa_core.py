"""The attention core of lifting / group self-attention: a two-level softmax with its own backward.

Letters: Z = batch * heads, L query points, Lkv key points, G query group elements, M key group
elements, V output group elements, J neighbours per query (P*P when local, all points when
global), d channels per head, e spatial-encoding channels (the first e of d), P = Z * Lc query
points of a chunk (z-major), K = V for the paper's form and 1 for one query per output element.

For output (i, v), query element g and key (j, m) the logit is (GSA-Nets Eq. 16, q pre-scaled
by 1/sqrt(d))

    c[j, m, g] + s[v, j, g],   c = q_ig . k_jm + q_ig . rho_H(g^-1 m),
                               s = q_ig . rho_xy(v^-1 dx_j)

and the softmax runs jointly over (j, m). Because s does not depend on m, it factorises into
two ordinary softmaxes:

    softmax_(j,m)(c + s) = pi[j, m, g] * beta[v, j, g]
    pi   = softmax_m(c[j, :, g])                     inner: over the key's group axis
    lse  = logsumexp_m(c[j, :, g])
    beta = softmax_j(s[v, :, g] + lse[:, g])         outer: over neighbours

so out(i, v) = sum_(j, g) beta[v, j, g] W[j, g] with W[j, g] = sum_m pi[j, m, g] val[j, m]. The
largest tensors hold P * J * M * G and P * V * J * G numbers; the reference's P * V * G * J * M
logit tensor never exists. Each factor is stable on its own: the outer logits contain the
inner log-normaliser, so the joint maximum is what gets subtracted. With one query per output
element (g = v) the outer softmax has K = 1 row per g.

Layouts are chosen so that the big contractions are batched products over P with J*M or J*G
rows (content, values, dq, dk), and only the per-neighbour (M x G) products are small.

:class:`FactorisedAttention` runs this over chunks of queries and saves only q, k, v and the
encodings for the backward pass, where each chunk is recomputed and differentiated by hand:
peak memory is one chunk's working set, whatever the image size. Attention dropout drops
entries of pi (shared by every v); each chunk's mask is drawn from a seed, and drawn again in
the backward. On CPU a chunk's tensors live in per-thread scratch buffers (:class:`_Scratch`)
and the chunks are shared among threads (:func:`_in_workers`). There, the chunk loops run in C++
(:mod:`symattn_cli.nn.gsa_native`, the same operations in the same order) when the extension
is available: from Python, each of a chunk's ~80 tensor calls takes the GIL, for which the
attention threads would wait on each other.

:func:`dense_attention` is the reference algorithm (full logits, autograd), kept for the
reference's v-dependent group index (a negative control) and as a test oracle.
"""

from __future__ import annotations

import contextlib
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from symattn_cli.nn import gsa_native

FORMS = ("sum", "single")

# ATen multiplies batched matrices with contraction * rows * cols below this on a scalar loop.
SCALAR_BMM_SIZE = 400
PACKED_ROWS = 8  # tiny products are packed into block-diagonal matrices of at least this size


def _host_paths(device: torch.device) -> bool:
    """Whether the core takes its CPU paths on ``device``: packed small products, sums and
    broadcasts through 0/1 matrices, per-thread scratch buffers, worker threads and the C++
    chunk loops. Elsewhere (GPUs) it takes plain batched operations, fresh buffers and one
    thread running the Python loops: the same values. The one place that decides, so that the
    tests can run those paths on the CPU (the ``loops`` fixture's ``"accelerator"``)."""
    return device.type == "cpu"


class _Packed:
    """Tiny matrices ``a`` ``(n, r, c)`` (one per row of a chunk) for products ``a @ b`` and
    ``a^T @ b`` with ``b`` ``(n, r or c, cols)``.

    The per-neighbour group products of small groups (4 x 4 by 4 x d for R4) fall on ATen's
    scalar batched-matmul loop. Packing f consecutive ones as the diagonal blocks of one
    (f r) x (f c) matrix (zeros elsewhere; b and the result are the same memory, viewed f at a
    time) sends them to the BLAS path, which is 2-4x faster despite the f-fold wasted work.
    Exact: the extra terms are products with zero. One packed copy serves both products (the
    transpose of a block-diagonal matrix is block-diagonal). The blocks live in ``scratch``,
    whose zeros stay zero from chunk to chunk: only the diagonal is written. ``mask`` (a's
    shape, or None) multiplies ``a`` on its way in (attention dropout); unpacked, the product
    goes to the ``"kept"`` buffer.
    """

    def __init__(self, a: torch.Tensor, cols: int, scratch: _Scratch, mask=None) -> None:
        n, r, c = a.shape
        f = max(1, PACKED_ROWS // max(r, c))
        self.a, self.f = a, f
        if not _host_paths(a.device) or f == 1 or n % f or c * r * cols >= SCALAR_BMM_SIZE:
            self.f = 1
            if mask is not None:
                self.a = torch.mul(a, mask, out=scratch.empty("kept", n, r, c))
            return
        blocks = scratch.zeros("blocks", n // f, f, r, f, c)
        diagonal = blocks.diagonal(dim1=1, dim2=3)  # (n / f, r, c, f)
        a = a.view(n // f, f, r, c).permute(0, 2, 3, 1)  # (n / f, r, c, f)
        if mask is None:
            diagonal.copy_(a)
        else:
            torch.mul(a, mask.view(n // f, f, r, c).permute(0, 2, 3, 1), out=diagonal)
        self.a = blocks.view(n // f, f * r, f * c)

    def bmm(self, b: torch.Tensor, out: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        """``a @ b`` (or ``a^T @ b``) into ``out`` ``(n, c or r, cols)``."""
        a = self.a.transpose(1, 2) if transpose else self.a
        if self.f == 1:
            return torch.bmm(a, b, out=out)
        n, f = b.shape[0], self.f
        torch.bmm(a, b.reshape(n // f, f * b.shape[1], -1), out=out.view(n // f, -1, out.shape[2]))
        return out


_LOCAL = threading.local()


BLOCK_GROUP_TABLE = True  # group logits as one GEMM with a block-diagonal table
NATIVE = True  # run the chunk loops in C++ where the extension is available (CPU)


@contextlib.contextmanager
def plain_products():
    """Within: no packed products and no sums through 0/1 matrices (the same values), so that
    a FLOP counter counts the algorithm's arithmetic, not the zeros of the packed blocks or
    additions done as matrix products. Not thread-safe: for measurements on one thread."""
    global PACKED_ROWS, GEMM_SUM_MAX, GEMM_SCALE_MAX, NATIVE, BLOCK_GROUP_TABLE
    saved = PACKED_ROWS, GEMM_SUM_MAX, GEMM_SCALE_MAX, NATIVE, BLOCK_GROUP_TABLE
    PACKED_ROWS, GEMM_SUM_MAX, GEMM_SCALE_MAX, BLOCK_GROUP_TABLE = 1, 0, 0, False
    NATIVE = False  # the Python loops, whose tensor calls a dispatch mode sees
    try:
        yield
    finally:
        PACKED_ROWS, GEMM_SUM_MAX, GEMM_SCALE_MAX, NATIVE, BLOCK_GROUP_TABLE = saved


def _native_loops(q: torch.Tensor):
    """The C++ chunk loops (:mod:`gsa_native`) for a call on ``q``, or None for Python's."""
    if not NATIVE or not _host_paths(q.device) or q.dtype not in (torch.float32, torch.float64):
        return None
    return gsa_native.load()


def chunk_loops(device) -> str:
    """The chunk loops a (float32) call on ``device`` runs: ``"c++"`` (CPU, with the extension
    built) or ``"python"`` (other devices, ``SYMATTN_NATIVE=0``, under :func:`plain_products`,
    or a failed build: the same values, slower)."""
    if not _host_paths(torch.device(device)):  # without allocating on it
        return "python"
    return "python" if _native_loops(torch.empty(0)) is None else "c++"


def _tunables() -> list[int]:
    """The size thresholds the C++ loops read (in the order they take them)."""
    return [PACKED_ROWS, GEMM_SUM_MAX, GEMM_SCALE_MAX, SCALAR_BMM_SIZE]


class _Scratch:
    """Named buffers for the tensors of one chunk, reused by the next chunk of the same thread.

    A chunk allocates a dozen tensors of about a megabyte and frees them a few milliseconds
    later, chunk after chunk and layer after layer, between the longer-lived activations and
    gradients: glibc's heap fragments, and the peak resident memory grew step after step
    (measured: from 78 to 102 MB over six training steps of the rotMNIST r4 net). Taking them
    from per-thread buffers that only grow (to the largest chunk seen) keeps the heap flat.
    ``reuse=False`` (chunks kept for the backward, or not on a CPU) allocates afresh.
    """

    def __init__(self, like: torch.Tensor, reuse: bool) -> None:
        self.like = like
        self.buffers = self.views = None
        if reuse and _host_paths(like.device):
            local = getattr(_LOCAL, "scratch", None)
            if local is None:
                local = _LOCAL.scratch = ({}, {})
            self.buffers, self.views = local

    def empty(self, name: str, *shape: int) -> torch.Tensor:
        return self._get(name, shape, zeros=False)

    def zeros(self, name: str, *shape: int) -> torch.Tensor:
        """Zeros when created; later calls with the same trailing shape return the buffer as
        the last user left it (the packing writes only where it wrote before)."""
        return self._get(name, shape, zeros=True)

    def _get(self, name: str, shape: tuple[int, ...], zeros: bool) -> torch.Tensor:
        if self.buffers is None:
            return self.like.new_zeros(shape) if zeros else self.like.new_empty(shape)
        base = (name, shape[1:] if zeros else (), self.like.dtype, self.like.device)
        # The view of each shape is kept too: chunks repeat their shapes, and every tensor
        # call saved is one hold of the GIL less for the other attention threads to wait on.
        view = self.views.get((base, shape))
        if view is not None:
            return view
        n = math.prod(shape)
        buf = self.buffers.get(base)
        if buf is None or buf.numel() < n:
            buf = self.buffers[base] = self.like.new_zeros(n) if zeros else self.like.new_empty(n)
            for key in [key for key in self.views if key[0] == base]:
                del self.views[key]  # views of the buffer just replaced
        view = self.views[base, shape] = buf[:n].view(shape)
        return view


def _spatial_logits(q_xy: torch.Tensor, rho: torch.Tensor, form: str, rows: slice, scratch):
    """s ``(P, K, J, G)`` (contiguous) from q_xy ``(Z, Lc, G, e)`` and rho ``(V, J, e)`` or
    ``(V, L, J, e)``, in ``scratch`` (a :class:`_Scratch`, or None to allocate)."""
    z, lc, g, e = q_xy.shape
    if rho.dim() == 3:  # local: one table for every query
        v, j = rho.shape[:2]
        if form == "sum":  # one GEMM (PG, e) x (e, VJ) for the chunk
            p, table = z * lc, rho.reshape(v * j, e)  # (VJ, e)
            q2 = q_xy.reshape(p * g, e)  # (PG, e)
            if scratch is None:  # under autograd (the dense algorithm)
                return (q2 @ table.T).view(p, g, v, j).permute(0, 2, 3, 1).contiguous()
            s = scratch.empty("t", p, v * j, g)  # (P, VJ, G)
            if g == 1:
                torch.mm(q2, table.T, out=s.view(p, v * j))
            else:  # the GEMM's (P, G, VJ), transposed (the softmax broadcast is free now)
                pgv = torch.mm(q2, table.T, out=scratch.empty("expand", p * g, v * j))
                s.copy_(pgv.view(p, g, v * j).transpose(1, 2))
            return s.view(p, v, j, g)  # (P, V, J, G)
        s = torch.einsum("zlge,gje->zljg", q_xy, rho)  # (Z, Lc, J, G): v = g
        return s.reshape(z * lc, 1, j, g).contiguous()  # (P, 1, J, G)
    r = rho[:, rows]  # (V, Lc, J, e): global, one table per query
    if form == "sum":
        s = torch.einsum("zlge,vlje->zlvjg", q_xy, r)  # (Z, Lc, V, J, G)
        return s.reshape(z * lc, r.shape[0], r.shape[2], g).contiguous()  # (P, V, J, G)
    s = torch.einsum("zlge,glje->zljg", q_xy, r)  # (Z, Lc, J, G)
    return s.reshape(z * lc, 1, r.shape[2], g).contiguous()  # (P, 1, J, G)


def _spatial_grads(ds, q_xy, rho, form: str, rows: slice, grad_rho, scratch) -> torch.Tensor:
    """Backward of :func:`_spatial_logits`: returns dq_xy, accumulates into ``grad_rho``."""
    z, lc, g, e = q_xy.shape
    if rho.dim() == 3:
        v, j = rho.shape[:2]
        if form == "sum":  # two GEMMs over the chunk, with ds as (PG, VJ)
            p, table = z * lc, rho.reshape(v * j, e)  # (VJ, e)
            q2 = q_xy.reshape(p * g, e)  # (PG, e)
            if g == 1:
                dsg = ds.reshape(p, v * j)
            else:  # the softmaxes are done with the broadcast buffer
                dsg = scratch.empty("expand", p, g, v * j)
                dsg.copy_(ds.view(p, v * j, g).transpose(1, 2))
                dsg = dsg.view(p * g, v * j)
            grad_rho += (dsg.T @ q2).view(v, j, e)
            return (dsg @ table).view(z, lc, g, e)
        ds = ds.view(z, lc, -1, g)  # (Z, Lc, J, G)
        grad_rho += torch.einsum("zljg,zlge->gje", ds, q_xy)
        return torch.einsum("zljg,gje->zlge", ds, rho)
    r = rho[:, rows]  # (V, Lc, J, e)
    if form == "sum":
        ds = ds.view(z, lc, r.shape[0], -1, g)  # (Z, Lc, V, J, G)
        grad_rho[:, rows] += torch.einsum("zlvjg,zlge->vlje", ds, q_xy)
        return torch.einsum("zlvjg,vlje->zlge", ds, r)
    ds = ds.view(z, lc, -1, g)  # (Z, Lc, J, G)
    grad_rho[:, rows] += torch.einsum("zljg,zlge->glje", ds, q_xy)
    return torch.einsum("zljg,glje->zlge", ds, r)


class _Unstable(Exception):
    """exp of unshifted logits overflowed or underflowed: redo the chunk with shifts."""


# Sums and broadcasts over a middle axis of length a with a short contiguous inner axis b
# (the softmaxes here: a = M or J, b = G) run on a slow strided loop in ATen: (252, 25, 4, 4)
# summed over its third axis takes 115 us on one core. As a product with a 0/1 matrix
# (``kron(ones(a, 1), eye(b))``) the same sum is one GEMM and takes 31 us; the broadcast
# multiply (147 us) becomes a GEMM and a contiguous multiply (32 us). Worth it for b <= 4
# (for b = 8 the GEMM sum is still 20% faster, the broadcast is not; above, ATen wins).
GEMM_SUM_MAX = 8  # inner lengths b summed through a 0/1 matrix
GEMM_SCALE_MAX = 4  # inner lengths b broadcast through a 0/1 matrix
_SEGMENTS: dict[tuple, torch.Tensor] = {}


def _segments(a: int, b: int, like: torch.Tensor) -> torch.Tensor:
    """``(a * b, b)``: a stacked ``b x b`` identities, cached per shape, dtype and device."""
    key = (a, b, like.dtype, like.device)
    table = _SEGMENTS.get(key)
    if table is None:
        table = _SEGMENTS[key] = torch.eye(b, dtype=like.dtype, device=like.device).repeat(a, 1)
    return table


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``(R, a, b)`` contiguous -> its sum over a, ``(R, b)``."""
    r, a, b = x.shape
    if not 1 < b <= GEMM_SUM_MAX or not _host_paths(x.device):
        return x.sum(1)
    return x.view(r, a * b) @ _segments(a, b, x)


def _segment_expand(y: torch.Tensor, a: int, scratch: _Scratch) -> torch.Tensor:
    """``y`` ``(R, b)`` repeated over a new middle axis: ``(R, a, b)`` (contiguous, in
    ``scratch``, for short b; else a broadcast view)."""
    r, b = y.shape
    if not 1 < b <= GEMM_SCALE_MAX or not _host_paths(y.device):
        return y.unsqueeze(1).expand(r, a, b)
    out = scratch.empty("expand", r, a * b)
    return torch.mm(y, _segments(a, b, y).T, out=out).view(r, a, b)


def _softmax_(x: torch.Tensor, shift: bool, scratch: _Scratch) -> torch.Tensor:
    """In-place softmax of a contiguous ``(R, a, b)`` over its middle axis (faster on CPU
    than ``torch.softmax`` for the 4-25 long axes here); returns the logsumexp ``(R, b)``.

    ``shift=False`` skips subtracting the maximum (two passes over the largest tensors) and
    raises :class:`_Unstable` when a normaliser overflows or is so small that a weight above
    rounding level (eps * normaliser) could be subnormal; the caller then recomputes with
    ``shift=True``. Both give the same softmax.
    """
    top = None
    if shift:
        top = x.amax(1)  # (R, b)
        x.sub_(top.unsqueeze(1))
    x.exp_()
    total = _segment_sum(x)  # (R, b)
    if not shift:
        info = torch.finfo(x.dtype)
        low, high = torch.aminmax(total)  # NaN fails both tests
        if not (low.item() >= info.tiny / info.eps and high.item() <= info.max):
            raise _Unstable
    x.mul_(_segment_expand(total.reciprocal(), x.shape[1], scratch))
    lse = total.log_()
    return lse if top is None else lse.add_(top)


class _Chunk:
    """The forward quantities of one chunk of queries (recomputed in the backward).

    ``drop``, ``seed``: attention dropout drops entries of pi with probability ``drop``, by
    a mask drawn from ``seed`` (the same mask when the chunk is recomputed; the 1 / (1 - drop)
    rescaling is the caller's). With one key and one query element per point (lifting), pi = 1
    and is not stored. ``hidden``: the chunk's ``(Lc, J)`` offsets from :func:`_hidden`, or
    None. Its tensors live in ``scratch`` (:class:`_Scratch`).
    """

    def __init__(self, q, k, v, group_logits, rho, nb, hidden, form, drop, seed, rows, shift,
                 scratch):  # fmt: skip
        z, lc, g, d = q.shape
        m, j = k.shape[2], nb.shape[1]
        p = z * lc
        e = 0 if rho is None else rho.shape[-1]
        idx = nb.reshape(-1)
        self.scratch = scratch
        self.q = q.reshape(p, g, d)  # (P, G, d)
        k_nb, v_nb = scratch.empty("k_nb", z, lc * j, m, d), scratch.empty("v_nb", z, lc * j, m, d)
        self.k_nb = torch.index_select(k, 1, idx, out=k_nb).view(p, j * m, d)  # (P, JM, d)
        self.v_nb = torch.index_select(v, 1, idx, out=v_nb).view(p, j * m, d)  # (P, JM, d)
        self.keep = None if not drop else _keep_mask((p, j, m, g), drop, seed, scratch)
        c = scratch.empty("c", p, j * m, g)
        torch.bmm(self.k_nb, self.q.transpose(1, 2), out=c)
        c = c.view(p, j, m, g)  # (P, J, M, G)
        if group_logits is not None:
            c += group_logits.reshape(p, 1, m, g)
        if m == 1 and g == 1:  # lifting: the inner softmax is over one element
            self.pi = None
            lse = c.view(p, j, 1)
            self.packed = None
            w = self.v_nb  # (P, J, d)
            if drop:
                w = torch.mul(w, self.keep.view(p, j, 1), out=scratch.empty("w", p, j, d))
        else:
            lse = _softmax_(c.view(p * j, m, g), shift, scratch).view(p, j, g)  # c is now pi
            self.pi = c
            # (PJ, M, G) as they lie (contiguous runs of G for the packing to copy); W takes
            # the transposed product. Dropout: times the mask.
            mask = None if self.keep is None else self.keep.view(p * j, m, g)
            self.packed = _Packed(c.view(p * j, m, g), d, scratch, mask)
            w = scratch.empty("w", p * j, g, d)
            self.packed.bmm(self.v_nb.view(p * j, m, d), w, transpose=True)
        self.w = w.view(p, j * g, d)  # (P, JG, d)
        if hidden is not None:  # neighbours outside the image take no weight: -inf logits
            lse = (lse.view(z, lc, j, g) + hidden[None, :, :, None]).view(p, j, g)
        if e:
            t = _spatial_logits(q[..., :e], rho, form, rows, scratch)  # (P, K, J, G)
            t.add_(lse.view(p, 1, j, g))
        else:
            t = lse.reshape(p, 1, j, g).clone()  # (P, 1, J, G)
        _softmax_(t.view(-1, j, g), shift, scratch)
        self.beta = t  # (P, K, J, G): outer softmax over j
        self.shape = (z, lc, g, m, j, d, p, e)

    def output(self, form: str, n: int) -> torch.Tensor:
        """``(P, V, d)``."""
        p, k, j, g = self.beta.shape
        if form == "single":  # out[g] = sum_j beta[j, g] W[j, g]
            w = self.w.view(p, j, g, -1)
            return (self.beta.view(p, j, g, 1) * w).sum(1)  # (P, G, d)
        out = torch.bmm(self.beta.view(p, k, j * g), self.w)  # (P, K, d)
        return out if k == n else out.expand(p, n, -1)  # no spatial term: same for every v

    def backward(self, go: torch.Tensor, form: str):
        """``go`` ``(P, V, d)`` -> d_t ``(P, K, J, G)``, d_c ``(P, JM, G)``, d_vnb ``(P, JM, d)``:
        the gradients of the outer logits, the inner logits and the gathered values."""
        z, lc, g, m, j, d, p, e = self.shape
        beta = self.beta  # (P, K, J, G)
        kk = beta.shape[1]
        if form == "single":
            w = self.w.view(p, 1, j, g, d)
            d_t = (w * go.view(p, 1, 1, g, d)).sum(-1).mul_(beta)  # (P, 1, J, G): beta d_beta
            d_w = (beta[..., None] * go.view(p, 1, 1, g, d)).reshape(p, j * g, d)  # (P, JG, d)
        else:
            if kk == 1:
                go = go.sum(1, keepdim=True)  # (P, 1, d): every v had the same weights
            d_t = torch.bmm(go, self.w.transpose(1, 2), out=self.scratch.empty("d_t", p, kk, j * g))
            d_t = d_t.view(p, kk, j, g).mul_(beta)  # (P, K, J, G): beta d_beta
            d_w = self.scratch.empty("w", p, j * g, d)  # (P, JG, d); d_t has used w
            torch.bmm(beta.view(p, kk, j * g).transpose(1, 2), go, out=d_w)
        # softmax over j: d_t = beta * (d_beta - sum_j beta d_beta)
        total = _segment_expand(_segment_sum(d_t.view(p * kk, j, g)), j, self.scratch)
        d_t.view(p * kk, j, g).addcmul_(beta.view(p * kk, j, g), total, value=-1.0)
        d_lse = d_t.sum(1)  # (P, J, G)
        if self.pi is None:  # lifting: pi = 1, d_c = d_lse
            d_vnb = d_w if self.keep is None else d_w * self.keep.view(p, j, 1)
            return d_t, d_lse.view(p, j, 1), d_vnb.view(p, j, d)
        d_w = d_w.view(p * j, g, d)  # (PJ, G, d)
        d_pi = self.scratch.empty("t", p * j, m, g)  # (PJ, M, G); beta is done with
        torch.bmm(self.v_nb.view(p * j, m, d), d_w.transpose(1, 2), out=d_pi)
        d_vnb = self.scratch.empty("v_nb", p * j, m, d)  # (PJ, M, d); d_pi has used v_nb
        self.packed.bmm(d_w, d_vnb)
        if self.keep is not None:
            d_pi.mul_(self.keep.view(p * j, m, g))
        # softmax and logsumexp over m: d_c = pi * (d_pi - sum_m pi d_pi + d_lse)
        d_c = d_pi.mul_(self.pi.view(p * j, m, g))  # (PJ, M, G): pi d_pi
        corr = _segment_sum(d_c).sub_(d_lse.view(p * j, g))  # (PJ, G)
        d_c.addcmul_(self.pi.view(p * j, m, g), _segment_expand(corr, m, self.scratch), value=-1.0)
        return d_t, d_c.view(p, j * m, g), d_vnb.view(p, j * m, d)


def _hidden(valid: torch.Tensor | None, chunks: list[slice], dtype) -> list:
    """Per chunk, the ``(Lc, J)`` logit offsets that hide neighbours outside the image (0 or
    -inf), or None where every neighbour of the chunk is inside; built once per call in the
    forward, and kept for the backward's recomputation."""
    if valid is None:
        return [None] * len(chunks)
    offsets = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    offsets.masked_fill_(~valid, -math.inf)
    return [None if bool(valid[rows].all()) else offsets[rows] for rows in chunks]


DROP_STEPS = 1 << 15  # dropout rates are multiples of 2^-15


def _keep_mask(shape, p: float, seed: int, scratch: _Scratch) -> torch.Tensor:
    """Keep mask of the scratch's dtype and device, 0 with probability ``p`` (a multiple of
    2^-15) and 1 otherwise, drawn from ``seed``: 15 random bits per entry, four entries per
    64-bit draw (a quarter of the cost of ``torch.rand``)."""
    n = math.prod(shape)
    device = scratch.like.device
    bits = torch.empty((n + 3) // 4, dtype=torch.int64, device=device)
    bits.random_(generator=torch.Generator(device=device).manual_seed(seed))  # [0, 2^63)
    u15 = bits.view(torch.int16)[:n].view(shape).bitwise_and_(DROP_STEPS - 1)  # [0, 2^15)
    return torch.ge(u15, round(p * DROP_STEPS), out=scratch.empty("keep", *shape))


class FactorisedAttention(torch.autograd.Function):
    """``out (Z, L, V, d)`` from q ``(Z, L, G, d)`` (pre-scaled by 1/sqrt(d)), k, v
    ``(Z, Lkv, M, d)``; with attention dropout, the output still needs its 1 / (1 - drop).

    ``group_rho`` ``(G, M, c)`` or None: the group encoding rho_H(g^-1 m), dotted with the
    last c channels of q (:func:`_group_logits`); ``rho`` ``(V, J, e)`` (local),
    ``(V, L, J, e)`` (global) or None, dotted with the first e; ``neighbour`` ``(L, J)``
    indices into Lkv; ``valid`` ``(L, J)`` bool or None; ``n`` = V; ``drop`` the
    attention-dropout rate; ``chunk`` queries per chunk; ``recompute`` recomputes each chunk
    in the backward instead of keeping it (memory).
    """

    @staticmethod
    def forward(ctx, q, k, v, group_rho, rho, neighbour, valid, form, n, drop, chunk,
                recompute, threads):  # fmt: skip
        # Rows are gathered and scattered: strided inputs would make every gather slow.
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        group_logits = None if group_rho is None else _group_logits(q, group_rho)  # (Z,L,M,G)
        z, n_q, g, d = q.shape
        m, j = k.shape[2], neighbour.shape[1]
        # Keep the chunks for the backward only if there will be one (inference keeps none).
        keep_chunks = not recompute and any(ctx.needs_input_grad[:5])
        chunks = [slice(lo, min(lo + chunk, n_q)) for lo in range(0, n_q, chunk)]
        # One dropout seed per chunk, drawn here in order so that torch's seed fixes the masks
        # whatever the workers do; the backward redraws each mask from its seed. They are
        # drawn on the host, whatever the device: they become Python ints.
        seeds = (torch.randint(1 << 62, (len(chunks),), device="cpu").tolist() if drop > 0
                 else [0] * len(chunks))  # fmt: skip
        hidden = _hidden(valid, chunks, q.dtype)
        # Stored as (Z, d, V, L): the layer's W_out reads it as (B, h d, V, L) without a copy.
        out = q.new_empty(z, d, n, n_q).permute(0, 3, 2, 1)  # (Z, L, V, d)
        shifts: list[bool] = [False] * len(chunks)
        kept: list[_Chunk | None] = [None] * len(chunks)
        native = _native_loops(q)
        bounds = [rows.start for rows in chunks] + [n_q]

        def run(indices: list[int]):
            """Chunks ``indices``; returns the C++ loops' kept chunks (or None)."""
            if native is not None:
                found, handle = native.forward_chunks(
                    q, k, v, group_logits, rho, neighbour, hidden, form == "single", n, drop,
                    seeds, bounds, indices, out, keep_chunks, _tunables(),
                )  # fmt: skip
                for i, shift in zip(indices, found, strict=True):
                    shifts[i] = shift
                return handle
            for i in indices:
                rows = chunks[i]
                args = (q[:, rows], k, v, None if group_logits is None else group_logits[:, rows],
                        rho, neighbour[rows], hidden[i], form, drop,
                        seeds[i], rows)  # fmt: skip
                scratch = _Scratch(q, reuse=not keep_chunks)
                try:
                    ch = _Chunk(*args, shift=False, scratch=scratch)
                except _Unstable:
                    ch, shifts[i] = _Chunk(*args, shift=True, scratch=scratch), True
                out[:, rows] = ch.output(form, n).view(z, -1, n, d)
                if keep_chunks:
                    kept[i] = ch
            return None

        handles = _in_workers(run, len(chunks), q.device, z * n_q * j * m * g, threads)
        ctx.save_for_backward(q, k, v, group_rho, rho, neighbour)
        ctx.args = (form, n, drop, chunks, seeds, shifts, threads, hidden)
        # kept chunks: the C++ loops' handles (one per worker) or the Python loops' chunks
        ctx.kept = [] if not keep_chunks else handles if native is not None else kept
        ctx.native = native is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, group_rho, rho, neighbour = ctx.saved_tensors
        form, n, drop, chunks, seeds, shifts, threads, hidden = ctx.args
        # Chunks kept by one kind of loop are differentiated by the same kind; without them
        # (or if the C++ loops that kept them are off now) every chunk is recomputed.
        native = _native_loops(q) if ctx.native or not ctx.kept else None
        handles = ctx.kept if native is not None and ctx.native else []
        python_kept = ctx.kept if not ctx.native else []
        group_logits = None  # (Z, L, M, G) for chunks to recompute: one product with q
        if group_rho is not None and not (handles or python_kept):
            group_logits = _group_logits(q, group_rho)
        # grad_out (Z, L, V, d) arrives permuted from W_out: each chunk copies its own rows.
        grad_q = torch.empty_like(q)
        grad_gl = None if group_rho is None else q.new_empty(*q.shape[:2], *group_rho.shape[1::-1])
        grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
        bounds = [rows.start for rows in chunks] + [q.shape[1]]

        def run(indices: list[int]):
            """Chunks ``indices`` (consecutive); returns the first key row this worker's dk and
            dv start at, them, and its sum of d_rho. The worker with the first chunk (the
            calling thread) adds into grad_k and grad_v themselves; the others into the band
            of key rows their queries reach, added in afterwards (in a fixed order: the
            gradients do not depend on timing)."""
            if native is not None:
                return native.backward_chunks(
                    q, k, v, group_logits, rho, neighbour, hidden, form == "single", n, drop,
                    seeds, bounds, shifts, indices, grad_out, grad_q, grad_gl, grad_k, grad_v,
                    handles, _tunables(),
                )  # fmt: skip
            lo = 0
            dk, dv = grad_k, grad_v
            if indices[0] > 0:
                reached = neighbour[chunks[indices[0]].start : chunks[indices[-1]].stop]
                lo, hi = int(reached.min()), int(reached.max()) + 1
                dk = k.new_zeros(k.shape[0], hi - lo, *k.shape[2:])
                dv = torch.zeros_like(dk)
            grad_rho = None if rho is None else torch.zeros_like(rho)
            for i in indices:
                rows = chunks[i]
                ch = python_kept[i] if python_kept else None
                if ch is None:
                    ch = _Chunk(
                        q[:, rows], k, v, None if group_logits is None else group_logits[:, rows],
                        rho, neighbour[rows], hidden[i], form, drop,
                        seeds[i], rows, shift=shifts[i], scratch=_Scratch(q, reuse=True),
                    )  # fmt: skip
                z, lc, g, m, j, d, p, e = ch.shape
                d_t, d_c, d_vnb = ch.backward(grad_out[:, rows].reshape(p, n, d), form)
                if grad_gl is not None:
                    grad_gl[:, rows] = d_c.view(p, j, m, g).sum(1).view(z, lc, m, g)
                dq = torch.bmm(d_c.transpose(1, 2), ch.k_nb).view(z, lc, g, d)  # (Z, Lc, G, d)
                if e:
                    q_xy = q[:, rows, :, :e]
                    dq[..., :e] += _spatial_grads(d_t, q_xy, rho, form, rows, grad_rho, ch.scratch)
                grad_q[:, rows] = dq
                d_knb = ch.scratch.empty("k_nb", p, j * m, d)  # dq has used k_nb
                torch.bmm(d_c, ch.q, out=d_knb)
                idx = neighbour[rows].reshape(-1)
                if lo:
                    idx = idx - lo
                dk.index_add_(1, idx, d_knb.view(z, lc * j, m, d))
                dv.index_add_(1, idx, d_vnb.view(z, lc * j, m, d))
            return lo, dk, dv, grad_rho

        work = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * neighbour.shape[1]
        parts = _in_workers(run, len(chunks), q.device, work, threads)
        for lo, dk, dv, _ in parts[1:]:
            grad_k[:, lo : lo + dk.shape[1]] += dk
            grad_v[:, lo : lo + dv.shape[1]] += dv
        grad_rho = _sum_(*(part[3] for part in parts))
        grad_group_rho = None if group_rho is None else _group_grads(grad_gl, q, group_rho, grad_q)
        ctx.kept = []  # free them now; a second backward (retain_graph) recomputes
        return grad_q, grad_k, grad_v, grad_group_rho, grad_rho, *(None,) * 8


def _group_table(group_rho: torch.Tensor, d: int) -> torch.Tensor:
    """``(G d, M G)``: group_rho ``(G, M, c)`` placed so that q ``(.., G d)`` times it gives
    the group logits ``(.., M, G)``: block-diagonal over g, with group_rho[g] in the rows of
    q's last c channels of element g and zeros elsewhere."""
    g, m, c = group_rho.shape
    table = group_rho.new_zeros(g, d, m, g)
    table.diagonal(dim1=0, dim2=3)[d - c :] = group_rho.permute(2, 1, 0)  # (c, M, G)
    return table.view(g * d, m * g)


def _group_logits(q: torch.Tensor, group_rho: torch.Tensor) -> torch.Tensor:
    """q_ig . rho_H(g^-1 m) over q's last c channels: ``(Z, L, M, G)`` from q ``(Z, L, G, d)``
    (contiguous) and group_rho ``(G, M, c)``. One GEMM on q as it is (an einsum would first
    copy q's channel slice, and autograd would keep that copy); under :func:`plain_products`,
    the einsum, so that a FLOP counter sees no products with the table's zeros."""
    z, n_q, g, d = q.shape
    m, c = group_rho.shape[1:]
    if not BLOCK_GROUP_TABLE:
        return torch.einsum("zlgc,gmc->zlmg", q[..., d - c :], group_rho)
    return (q.view(z * n_q, g * d) @ _group_table(group_rho, d)).view(z, n_q, m, g)


def _group_grads(d_gl, q, group_rho, grad_q) -> torch.Tensor:
    """Backward of :func:`_group_logits`: adds into ``grad_q``, returns d group_rho."""
    z, n_q, g, d = q.shape
    m, c = group_rho.shape[1:]
    if not BLOCK_GROUP_TABLE:
        grad_q[..., d - c :] += torch.einsum("zlmg,gmc->zlgc", d_gl, group_rho)
        return torch.einsum("zlmg,zlgc->gmc", d_gl, q[..., d - c :])
    flat_q, flat_gl = q.view(z * n_q, g * d), d_gl.reshape(z * n_q, m * g)
    grad_q.view(z * n_q, g * d).addmm_(flat_gl, _group_table(group_rho, d).T)
    grad_table = (flat_q.T @ flat_gl).view(g, d, m, g)  # (G, d, M, G)
    return grad_table.diagonal(dim1=0, dim2=3)[d - c :].permute(2, 1, 0).contiguous()


def _sum_(first: torch.Tensor | None, *rest: torch.Tensor) -> torch.Tensor | None:
    """The workers' partial sums, added into the first."""
    for part in rest:
        first.add_(part)
    return first


_POOLS: dict[int, ThreadPoolExecutor] = {}
MIN_PARALLEL_WORK = 1 << 20  # logits per call below which threads cost more than they give


def _in_workers(run, n_chunks: int, device, work: int, threads: int = 0) -> list:
    """``run(indices)`` over consecutive groups of chunk indices, one group per CPU thread.

    The chunks' operations are small, and intra-op threading pays an OpenMP barrier per
    operation (expensive with passive waiting, ruinous with spinning on a busy machine).
    On CPU, the chunks are instead shared among ``threads`` Python threads (the calling one
    and ``threads - 1`` pool workers) whose operations run single-threaded (they release the
    GIL). ``threads=0`` takes ``torch.get_num_threads()``, and one thread below
    ``MIN_PARALLEL_WORK`` logits (``work``).
    On other devices, or with one thread, ``run`` sees every chunk in order. Results are
    returned per group.
    """
    if threads < 0:
        raise ValueError(f"attention threads={threads} must be >= 0 (0 = torch's thread count)")
    if threads == 0:
        threads = torch.get_num_threads() if work >= MIN_PARALLEL_WORK else 1
    workers = min(threads, n_chunks) if _host_paths(device) else 1
    if workers <= 1:
        with torch.no_grad():
            return [run(list(range(n_chunks)))]
    bounds = [n_chunks * w // workers for w in range(workers + 1)]
    groups = [list(range(bounds[w], bounds[w + 1])) for w in range(workers)]
    pool = _POOLS.get(workers - 1)
    if pool is None:
        pool = _POOLS[workers - 1] = ThreadPoolExecutor(workers - 1, thread_name_prefix="gsa-core")

    def task(indices):
        with torch.no_grad():  # grad mode is per thread
            return run(indices)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ATen reads this process-wide; restored below
    try:
        # The calling thread takes the first group: one thread (and malloc arena) fewer.
        futures = [pool.submit(task, idx) for idx in groups[1:]]
        try:
            first = task(groups[0])
        finally:
            rest = [f.result() for f in futures]  # wait for them even if the first failed
        return [first, *rest]
    finally:
        torch.set_num_threads(threads)


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return False


def _widen(t: torch.Tensor | None) -> torch.Tensor | None:
    """float16 / bfloat16 -> float32 (what autocast hands over); anything else as it is."""
    return t.float() if t is not None and t.dtype in (torch.float16, torch.bfloat16) else t


def factorised_attention(
    q, k, v, group_rho, rho, neighbour, valid, *, form: str, n: int, drop: float = 0.0,
    chunk: int, recompute: bool = True, threads: int = 0,
) -> torch.Tensor:  # fmt: skip
    """Functional entry point of :class:`FactorisedAttention` (q already scaled by 1/sqrt(d)).

    Attention dropout zeroes each entry of pi with probability ``drop`` (rounded to a multiple
    of 2^-15); the 1 / (1 - drop) rescaling is applied to the output here, outside the core
    (not to v, so that the core keeps the caller's v for its backward).

    Under autocast (mixed precision) the core runs in float32, forward and backward: its
    softmax statistics and chunk sums stay out of half precision, and its hand-written
    backward sees one dtype. The output is float32; the maps around it keep autocast.
    """
    if form not in FORMS:
        raise ValueError(f"form={form!r}; choose one of {FORMS}")
    if not 0.0 <= drop < 1.0:
        raise ValueError(f"attention dropout {drop} must be in [0, 1)")
    if _autocast_on(q.device.type):  # mixed precision: the core runs in float32
        with torch.autocast(q.device.type, enabled=False):
            q, k, v, group_rho, rho = (_widen(t) for t in (q, k, v, group_rho, rho))
            return factorised_attention(
                q, k, v, group_rho, rho, neighbour, valid, form=form, n=n, drop=drop,
                chunk=chunk, recompute=recompute, threads=threads,
            )  # fmt: skip
    drop = round(drop * DROP_STEPS) / DROP_STEPS
    out = FactorisedAttention.apply(
        q, k, v, group_rho, rho, neighbour, valid, form, n, drop, max(int(chunk), 1),
        recompute, threads,
    )  # fmt: skip
    return out * (1.0 / (1.0 - drop)) if drop > 0 else out


def dense_weights(q, k, group_rho, rho, neighbour, valid, *, form: str, n: int,
                  rows: slice) -> torch.Tensor:  # fmt: skip
    """The reference algorithm's attention probabilities ``(P, V, G, J, M)`` (G = 1 in the
    single form, where g = v) for the queries q ``(Z, Lc, G, d)`` (scaled) at ``rows`` of the
    layer's L: keys k ``(Z, Lkv, M, d)``, the queries' ``neighbour`` indices ``(Lc, J)`` and
    ``valid`` ``(Lc, J)`` or None; ``group_rho`` ``(G, M, E)`` or, v-dependent, ``(V, G, M,
    E)`` on q's channels after rho's e; ``rho`` ``(V, J, e)`` or ``(V, L, J, e)`` on the first
    e. Full logits, plain autograd."""
    z, lc, g, d = q.shape
    m, j = k.shape[2], neighbour.shape[1]
    e = 0 if rho is None else rho.shape[-1]
    p = z * lc
    k_nb = k.index_select(1, neighbour.reshape(-1)).view(p, j, m, d)  # (P, J, M, d)
    q2 = q.reshape(p, g, d)  # (P, G, d)
    full = torch.einsum("pgc,pjmc->pgjm", q2, k_nb)[:, None]  # (P, 1, G, J, M)
    if group_rho is not None:
        table = group_rho if group_rho.dim() == 4 else group_rho[None]  # (V or 1, G, M, E)
        gt = torch.einsum("pgc,vgmc->pvgm", q2[..., e:], table)  # (P, V or 1, G, M)
        full = full + gt[:, :, :, None, :]  # (P, V or 1, G, J, M)
    if e:
        s = _spatial_logits(q[..., :e], rho, "sum", rows, None)  # (P, V, J, G)
        full = full + s.permute(0, 1, 3, 2)[..., None]  # (P, V, G, J, M)
    full = full.expand(p, n, g, j, m)
    if form == "single":  # g = v only
        full = torch.diagonal(full, dim1=1, dim2=2).permute(0, 3, 1, 2)[:, :, None]
    if valid is not None:
        mask = valid.repeat(z, 1)[:, None, None, :, None]  # (P, 1, 1, J, 1)
        full = full.masked_fill(~mask, -math.inf)
    return torch.softmax(full.flatten(3), dim=-1).view_as(full)  # (P, V, G, J, M)


def dense_attention(q, k, v, group_rho, rho, neighbour, valid, *, form: str, n: int,
                    dropout: torch.nn.Module, chunk: int) -> torch.Tensor:  # fmt: skip
    """The reference algorithm: full ``(P, V, G, J, M)`` logits (:func:`dense_weights`), plain
    autograd.

    Same arguments as :class:`FactorisedAttention` except ``group_rho`` ``(V, G, M, E)``, a
    group encoding that may depend on v (the reference's (m - g + v) index), applied to the
    last E channels of q. Memory grows as N^3 P^2 per query, as in the reference.
    """
    z, n_q, g, d = q.shape
    m, j = k.shape[2], neighbour.shape[1]
    outs = []
    for lo in range(0, n_q, chunk):
        rows = slice(lo, min(lo + chunk, n_q))
        lc = rows.stop - rows.start
        attn = dense_weights(
            q[:, rows], k, group_rho, rho, neighbour[rows], None if valid is None else valid[rows],
            form=form, n=n, rows=rows,
        )  # fmt: skip
        v_nb = v.index_select(1, neighbour[rows].reshape(-1)).view(z * lc, j, m, d)  # (P,J,M,d)
        outs.append(torch.einsum("pvgjm,pjmc->pvc", dropout(attn), v_nb).view(z, lc, n, d))
    return torch.cat(outs, dim=1)  # (Z, L, V, d)
