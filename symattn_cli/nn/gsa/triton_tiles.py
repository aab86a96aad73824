"""The ``triton_tiles`` backend of the attention core: the tiled Triton kernel
(:mod:`symattn_cli.nn.gsa.triton_tiles_kernel`: a tile of queries a program, their neighbours'
halo, both products as matrix products) as an autograd function. It runs where the ``triton``
backend runs (CUDA, or CPU tensors in Triton's interpreter for tests) and takes the group
encoding itself, not the group logits.

The dispatcher hands over float32 or float64 tensors (half precision widened). dk, dv and
drho (and dq where a query's rows are split over programs, groups of 16 elements) are summed
by atomic adds, so on a GPU their last bits vary from run to run (under torch's deterministic
mode the backward raises or warns, as the ``triton`` backend's does); d grho is summed per
program and then over programs in a fixed order.
"""

from __future__ import annotations

from types import ModuleType

import torch

from symattn_cli.nn.gsa.common import alert_not_deterministic, gradient_copies
from symattn_cli.nn.gsa.triton import ENV, available, interpreted

# Columns (halo points times key elements) of a block of logits: each thread of the
# program's warps holds COLUMNS / 2 of its rows' logits.
COLUMNS = 32
# tl.dot takes operands of at least 16 along every axis
DOT_MIN = 16
# A warp holds 16 rows of the products (one matrix tile's height), whole, so that it reduces
# them without shared memory.
WARP_ROWS = 16
# Rows a program at most: the backward's matrix operands (q, the output gradient, dx, W; each
# as two parts) stay in shared memory, about 1.2 KiB a row; a query's rows r beyond this
# many are taken by further programs (chunks of rows r).
MAX_ROWS = 64
# float32 products on tensor cores at float32 accuracy (three TF32 products, the kernel's
# _dot); float64 on CUDA cores
PRECISION = {torch.float32: "tf32x3", torch.float64: "ieee"}
# Backward programs a multiprocessor: each takes tiles in turn and sums its d grho
PROGRAMS_PER_SM = 8
# Warps of a backward program at least where a local spatial term goes through products
# (SP_DOT): one warp holding a tile's rows, the tile's logits by neighbour and their
# gradients runs out of registers and spills.
SP_DOT_BACKWARD_WARPS = 2

_MASK32 = 0xFFFFFFFF
_NONE = torch.iinfo(torch.int64).max


def kernels() -> ModuleType:
    """The kernel module (imports Triton)."""
    from symattn_cli.nn.gsa import triton_tiles_kernel

    return triton_tiles_kernel


def _power2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def _rows(single: bool, rho, n: int, gl_v: bool) -> int:
    """T: the rows of the outer logits."""
    return n if gl_v or not (single or rho is None) else 1


def encoding(group_rho, single: bool):
    """The group encoding as the kernels read it, ``(Vg, G, M, c)`` (Vg = V when it depends on
    the output element, else 1), from ``(G, M, c)`` or ``(V, G, M, c)``; in the single form
    (g = v) the diagonal ``(1, G, M, c)``; None stays None."""
    if group_rho is None:
        return None
    if group_rho.dim() == 4 and single:
        group_rho = torch.diagonal(group_rho, dim1=0, dim2=1).permute(2, 0, 1)
    return (group_rho if group_rho.dim() == 4 else group_rho[None]).contiguous()


def tile_sizes(g: int, m: int, rows: int, d: int, c: int, e: int, j: int) -> dict[str, int]:
    """Block sizes, powers of two: BQ queries a tile, whose rows (query, outer row, element;
    ``rows``: the outer rows R of a query, 1 in the single form, BT = R rounded up) fill at
    least one matrix tile, BR of the rows r a program (CHUNKS programs a tile, at most
    :data:`MAX_ROWS` rows each), and BH halo points a block, whose BH BM columns are at least
    :data:`DOT_MIN` and about :data:`COLUMNS`; a spatial table's BE channels and BJ >=
    DOT_MIN neighbours (the tile's spatial logits by neighbour j, ``(rows, BJ)``, are a
    product; :func:`plan` raises BE to DOT_MIN where it forms them)."""
    bg, bm, bt = _power2(g), _power2(m), _power2(rows)
    bq = max(1, DOT_MIN // (bt * bg))
    br = max(1, min(bt, MAX_ROWS // (bq * bg)), DOT_MIN // (bq * bg))
    bh = max(_power2(-(-DOT_MIN // bm)), COLUMNS // bm)
    return dict(BQ=bq, BR=br, BT=bt, CHUNKS=bt // br, BH=bh, BG=bg, BM=bm,
                BD=max(_power2(d), DOT_MIN), BC=_power2(c), BE=_power2(e),
                BJ=max(_power2(j), DOT_MIN))  # fmt: skip


def tile_maps(neighbour, valid, offsets, bq: int, bh: int):
    """The tiles of BQ consecutive queries and their halos: ``halo (NT, H)`` the key points
    (a point once for each time one query lists it; -1 pads to a multiple of BH), ``slot (NT,
    BQ, H)`` which neighbour j of query iq each halo entry is (-1: none) and, with
    ``offsets``, ``row (NT, BQ, H)`` its row of rho (else None). Invalid neighbours are left
    out."""
    n_q, j = neighbour.shape
    dev = neighbour.device
    nb = neighbour.long()
    # the k-th listing of a point by a query is key (point, k): a repeated neighbour counts twice
    ordered, perm = torch.sort(nb, dim=1, stable=True)
    at = torch.arange(j, device=dev).expand(n_q, j)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    start = torch.where(first, at, 0).cummax(dim=1).values
    rank = torch.empty_like(nb).scatter_(1, perm, at - start)
    key = nb * j + rank
    if valid is not None:
        key = key.masked_fill(~valid, _NONE)
    n_t = -(-n_q // bq)
    pad = n_t * bq - n_q
    if pad:
        key = torch.cat([key, key.new_full((pad, j), _NONE)])
    keys = key.view(n_t, bq * j)
    ordered = keys.sort(dim=1).values
    new = ordered != _NONE
    new[:, 1:] &= ordered[:, 1:] != ordered[:, :-1]
    count = int(new.sum(dim=1).max()) if n_t else 0
    h = max(bh, -(-count // bh) * bh)
    place = torch.where(new, new.cumsum(dim=1) - 1, h)
    halo = keys.new_full((n_t, h + 1), _NONE).scatter_(1, place, ordered)[:, :h].contiguous()
    points = torch.where(halo == _NONE, -1, halo // j).to(torch.int32)
    listed = keys != _NONE
    place = torch.where(listed, torch.searchsorted(halo, keys), h).view(n_t, bq, j)

    def spread(values):
        out = torch.full((n_t, bq, h + 1), -1, dtype=torch.int32, device=dev)
        out.scatter_(2, place, values.to(torch.int32).expand(n_t, bq, j))
        return out[..., :h].contiguous()

    slot = spread(torch.arange(j, device=dev).view(1, 1, j))
    row = None
    if offsets is not None:
        off = offsets.long()
        if pad:
            off = torch.cat([off, off.new_zeros(pad, j)])
        row = spread(off.view(n_t, bq, j))
    return points, slot, row


def _launch(q, k, grho, rho, neighbour, offsets, valid, single: bool, n: int):
    """The kernels' tile maps, size arguments and block sizes."""
    _, n_q, g, d = q.shape
    n_kv, m = k.shape[1:3]
    j = neighbour.shape[1]
    gl_v = grho is not None and grho.shape[0] > 1
    c = 0 if grho is None else grho.shape[-1]
    e, distinct = (rho.shape[2], rho.shape[1]) if rho is not None else (0, 0)
    rows = _rows(single, rho, n, gl_v)
    blocks = tile_sizes(g, m, 1 if single else rows, d, c, e, j)
    blocks["BV"] = _power2(n)
    halo, slot, row = tile_maps(neighbour, valid, offsets, blocks["BQ"], blocks["BH"])
    sizes = (n_q, n_kv, halo.shape[0], halo.shape[1], j, m, g, d, c, e, distinct, n, rows)
    return (halo, slot, slot if row is None else row), sizes, blocks


class TiledAttention(torch.autograd.Function):
    """The kernels' forward and backward (arguments: see :func:`tiled_attention`)."""

    @staticmethod
    def forward(ctx, q, k, v, grho, rho, offsets, neighbour, valid, single, n, threshold, seed):
        z, n_q, _, d = q.shape
        out = q.new_empty(z, n_q, n, d)
        lse, rows = stats = statistics(q, grho, rho, single, n, out)
        # the tile maps and the keep mask, built once for both kernels
        ctx.plan = plan(q, k, v, grho, rho, offsets, neighbour, valid, single, n, threshold)
        if threshold > 0 and q.numel():
            kernel, grid, args, meta = keep_launch(ctx.plan, threshold, seed)
            kernel[grid](*args, **meta)
        if out.numel():
            kernel, grid, args, meta = forward_launch(out, stats, ctx.plan)
            kernel[grid](*args, **meta)
        ctx.save_for_backward(q, grho, lse, out if single else rows)
        ctx.rows = rows.shape
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, grho, lse, rows = ctx.saved_tensors
        alert_not_deterministic("attention_backend=triton_tiles's backward", q.device)
        stats = (lse, rows.view(ctx.rows))
        _, _, (_, k, v, _, rho, *_), meta = ctx.plan
        rho = rho if meta["HAS_RHO"] else None  # the plan holds a stand-in for an absent one
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        drho = None if rho is None else torch.zeros_like(rho)  # no queries: no gradient
        dgrho = None
        z, n_q = q.shape[:2]
        if z * n_q:
            kernel, grid, args, meta = backward_launch(
                (dq, dk, dv),
                grad_out,
                stats,
                ctx.plan,
                copies=gradient_copies(q, rho),
                programs=backward_programs(q),
            )
            kernel[grid](*args, **meta)
            if grho is not None:  # each program's part, summed in a fixed order
                dgrho = args[3].sum(dim=0)
            if rho is not None:  # the copies of drho, summed
                drho = args[4].sum(dim=0)
        elif grho is not None:
            dgrho = torch.zeros_like(grho)
        return dq, dk, dv, dgrho, drho, *(None,) * 7


def statistics(q, grho, rho, single: bool, n: int, out=None):
    """Empty tensors for what the forward keeps for the backward: the outer softmax's
    log-sum-exp ``(Z, L, T, G)`` and the rows' outputs O ``(Z, L, T, G, d)`` (in the single
    form the output ``out`` ``(Z, L, V, d)`` seen so, where given)."""
    z, n_q, g, d = q.shape
    gl_v = grho is not None and grho.shape[0] > 1
    t = _rows(single, rho, n, gl_v)
    rows = out.view(z, n_q, t, g, d) if single and out is not None else None
    return q.new_empty(z, n_q, t, g), q.new_empty(z, n_q, t, g, d) if rows is None else rows


def backward_programs(q, sms: int | None = None) -> int:
    """Programs of the backward on q's GPU (or one of ``sms`` multiprocessors):
    :data:`PROGRAMS_PER_SM` a multiprocessor; 2 on the CPU (the interpreter)."""
    if sms is None:
        if q.device.type != "cuda":
            return 2
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return PROGRAMS_PER_SM * sms


def keep_launch(launch, threshold: int, seed: int):
    """The kernel that draws dropout's keep mask into the plan's ``bits`` (:func:`plan`), its
    grid, arguments and keyword arguments: entries whose 15-bit hash of ``seed`` is at least
    ``threshold`` are kept."""
    program, _, args, meta = launch
    q, bits = args[0], args[5]
    j, m, g = args[13], args[14], args[15]
    bj = max(1, 1024 // (meta["BG"] * meta["BM"]))
    grid = (q.shape[0] * q.shape[1],)
    kwargs = dict(BJ=min(bj, _power2(j)), BM=meta["BM"], BG=meta["BG"], num_warps=4)
    return program.keep_bits, grid, (bits, j, m, g, seed & _MASK32, (seed >> 32) & _MASK32,
                                     threshold), kwargs  # fmt: skip


def forward_launch(out, stats, launch):
    """The forward kernel, its grid, arguments and keyword arguments (compile-time ones and
    launch options) for ``out`` ``(Z, L, V, d)`` (not written in the single form) and
    ``stats`` (:func:`statistics`) by ``launch`` (:func:`plan`)."""
    program, grid, args, meta = launch
    return program.attention_forward, grid, (out, *stats, *args), meta


def backward_launch(grads, grad_out, stats, launch, copies: int = 1, programs: int = 1):
    """The backward kernel, its grid (at most ``programs`` programs, each taking tiles in
    turn), arguments and keyword arguments by ``launch`` (:func:`plan`), writing ``grads``
    (dq, dk, dv: zeroed), each program's d grho (a new tensor, argument 3) and, with a spatial
    term, ``copies`` copies of drho (a new tensor ``(copies, V, D, e)``, argument 4) from
    ``grad_out`` ``(Z, L, V, d)`` and what the forward kept (:func:`statistics`); the caller
    sums both new tensors over their first axis."""
    program, grid, args, meta = launch
    q, grho, rho = args[0], args[3], args[4]
    if meta["BT"] == 1 and not meta["SINGLE"]:  # every v had the same output row: add them up
        grad_out = grad_out.sum(dim=2, keepdim=True)
    grad_out = grad_out.contiguous()
    dq, dk, dv = grads
    tiles = grid[0]
    grid = (max(1, min(tiles, programs)),)
    dgrho = q.new_zeros(grid[0], *grho.shape) if meta["HAS_GL"] else q
    drho = rho.new_zeros(copies, *rho.shape) if meta["HAS_RHO"] else q
    args = (dq, dk, dv, dgrho, drho, grad_out, *stats, *args, grad_out.shape[2], copies,
            tiles)  # fmt: skip
    if meta["SP_DOT"]:
        meta = {**meta, "num_warps": max(meta["num_warps"], SP_DOT_BACKWARD_WARPS)}
    return program.attention_backward, grid, args, meta


def plan(q, k, v, grho, rho, offsets, neighbour, valid, single, n, threshold):
    """The kernel module, the forward's grid, the kernels' common arguments (the tile maps and
    an empty tensor for the keep mask among them) and their compile-time ones, for the forward
    and the backward alike. Absent tensors are replaced by a stand-in that is never read."""
    maps, sizes, blocks = _launch(q, k, grho, rho, neighbour, offsets, valid, single, n)
    bits = q
    if threshold > 0:  # one bit per key element m of each (query, element g, neighbour)
        m = k.shape[2]
        if m > 32:
            raise ValueError(f"dropout on the tiled kernel takes at most 32 key elements, not {m}")
        dtype = torch.uint8 if m <= 8 else torch.int16 if m <= 16 else torch.int32
        bits = torch.empty(q.shape[0] * q.shape[1], q.shape[2], neighbour.shape[1],
                           dtype=dtype, device=q.device)  # fmt: skip
    args = (q, k, v, q if grho is None else grho, q if rho is None else rho, bits, *maps, *sizes)
    flags = dict(
        HAS_GL=grho is not None, GL_V=grho is not None and grho.shape[0] > 1,
        HAS_RHO=rho is not None, HAS_OFFSETS=offsets is not None, SINGLE=single,
        DROP=threshold > 0, PRECISION=PRECISION[q.dtype],
        # a local spatial term whose products outnumber the logits' (e > M: a lifting layer)
        # through the tile's logits by neighbour and each block's one-hot map (matrix products);
        # else rho gathered at each block's offsets
        SP_DOT=rho is not None and offsets is None and blocks["BE"] > blocks["BM"],
    )  # fmt: skip
    if flags["SP_DOT"]:  # the channels are the products' inner side
        blocks["BE"] = max(blocks["BE"], DOT_MIN)
    grid = (q.shape[0] * maps[0].shape[0] * blocks["CHUNKS"],)
    warps = max(1, blocks["BQ"] * blocks["BR"] * blocks["BG"] // WARP_ROWS)
    return kernels(), grid, args, {**flags, **blocks, "num_warps": warps}


def tiled_attention(q, k, v, group_rho, rho, offsets, neighbour, valid, single, n, threshold,
                    seed):  # fmt: skip
    """The factorised attention (:mod:`symattn_cli.nn.gsa.core`) by the tiled kernel, without
    the 1 / (1 - drop) rescaling: ``(Z, L, V, d)``. ``group_rho`` ``(G, M, c)``, or ``(V, G,
    M, c)`` where it depends on the output element v, or None: the group encoding on q's last
    c channels (the kernel forms the group logits); dropout keeps an entry whose 15-bit hash
    is at least ``threshold``. float32 or float64 CUDA tensors, or CPU tensors in Triton's
    interpreter."""
    if not available():
        raise ValueError(
            "attention backend 'triton_tiles' needs Triton, which ships with PyTorch's CUDA wheels "
            "(or pip install triton); use attention_backend=torch"
        )
    device = q.device
    if device.type != "cuda" and not (device.type == "cpu" and interpreted()):
        raise ValueError(
            f"attention backend 'triton_tiles' runs on CUDA tensors, not {device.type} ones (on "
            f"the CPU only in Triton's interpreter, {ENV}=1 before Triton is imported, which tests "
            "use); use attention_backend=auto or torch"
        )
    if q.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"attention backend 'triton_tiles' takes floating-point inputs, not {q.dtype}"
        )
    if any(t is not None and t.dtype != q.dtype for t in (k, v, group_rho, rho)):
        raise ValueError("q, k, v and the encodings must share one dtype")
    if group_rho is not None and group_rho.dim() == 4 and group_rho.shape[0] != n:
        raise ValueError(
            f"a v-dependent group encoding {tuple(group_rho.shape)} needs V = {n} rows"
        )

    def flat(t):
        return None if t is None else t.contiguous()

    grho = encoding(group_rho, single)
    q, k, v, rho = (flat(t) for t in (q, k, v, rho))
    args = (flat(offsets), flat(neighbour), flat(valid), single, n, threshold, seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            return TiledAttention.apply(q, k, v, grho, rho, *args)
    return TiledAttention.apply(q, k, v, grho, rho, *args)
