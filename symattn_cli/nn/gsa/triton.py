"""The ``triton`` backend of the attention core: the fused Triton kernel
(:mod:`symattn_cli.nn.gsa.triton_kernel`) as an autograd function, the backend on CUDA.

Triton runs kernels compiled for the GPU, or, when ``TRITON_INTERPRET=1`` is set before it is
imported, in its interpreter for the whole process, on CPU tensors too (its own
``triton.language`` functions are fixed to one mode as it is imported). The interpreter is how
the kernel is tested on machines without a GPU (``tests/conftest.py`` sets it there); it runs
each program in Python, far too slowly for anything else.

The dispatcher hands over float32 or float64 tensors (half precision widened). dk, dv and
drho are summed by atomic adds, so on a GPU their last bits vary from run to run; under
torch's deterministic mode the backward raises or warns, as torch's own such operations do
(:func:`~symattn_cli.nn.gsa.common.alert_not_deterministic`).
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from symattn_cli.nn.gsa.common import alert_not_deterministic, gradient_copies

ENV = "TRITON_INTERPRET"
# Numbers in a block's largest tensor, (BJ, BM, BG) or (BT, BJ, BG), held in registers: sized
# so that the sum form's backward compiles without register spills (r8: 16 neighbours a block).
BLOCK_ELEMENTS = 1024
# The same with a group term that depends on v, whose backward holds about twice as many such
# tensors: r8 at 8 neighbours a block (for sm_90, its backward 128 registers in float32 and 224
# in float64 with at most 12 bytes spilled; at 16, float64 hits 255 and spills 152 bytes).
BLOCK_ELEMENTS_V = 512
NUM_WARPS = 4

_MASK32 = 0xFFFFFFFF


def available() -> bool:
    """Whether Triton is installed (it ships with PyTorch's CUDA wheels)."""
    return importlib.util.find_spec("triton") is not None


def kernels() -> ModuleType:
    """The kernel module (imports Triton)."""
    from symattn_cli.nn.gsa import triton_kernel

    return triton_kernel


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (imports Triton)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernels().attention_forward, InterpretedFunction)


def _power2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def _rows(single: bool, rho, n: int, gl_v: bool) -> int:
    """T: the rows of the outer logits."""
    return n if gl_v or not (single or rho is None) else 1


def _launch(q, k, rho, neighbour, single: bool, n: int, threshold: int, seed: int,
            gl_v: bool = False):  # fmt: skip
    """The kernels' size arguments and block sizes; ``gl_v``: a group term that depends on
    v."""
    _, n_q, g, d = q.shape
    n_kv, m = k.shape[1:3]
    j = neighbour.shape[1]
    e, distinct = (rho.shape[2], rho.shape[1]) if rho is not None else (0, 0)
    rows = _rows(single, rho, n, gl_v)
    bm, bg, bd, bt = _power2(m), _power2(g), _power2(d), _power2(rows)
    # largest per-neighbour block: (BJ, BM, BG), (BT, BJ, BG), and with gl_v (BT, BJ, BM)
    widest = max(bm * bg, bt * bg, bt * bm if gl_v else 0)
    bj = max(1, (BLOCK_ELEMENTS_V if gl_v else BLOCK_ELEMENTS) // widest)
    bj = min(_power2(j), 1 << (bj.bit_length() - 1))  # a power of two
    sizes = (n_q, n_kv, j, m, g, d, e, distinct, n, rows,
             seed & _MASK32, (seed >> 32) & _MASK32, threshold)  # fmt: skip
    blocks = dict(BJ=bj, BM=bm, BG=bg, BD=bd, BT=bt, BO=bg if single else bt, BV=_power2(n))
    return sizes, blocks


class TritonAttention(torch.autograd.Function):
    """The kernel's forward and backward (arguments: see :func:`triton_attention`)."""

    @staticmethod
    def forward(ctx, q, k, v, gl, rho, offsets, neighbour, valid, single, n, threshold, seed):
        ctx.args = (offsets, neighbour, valid, single, n, threshold, seed)
        z, n_q, _, d = q.shape
        out = q.new_empty(z, n_q, n, d)
        lse = statistics(q, gl, rho, single, n)
        if out.numel():
            kernel, grid, args, meta = forward_launch(out, lse, q, k, v, gl, rho, *ctx.args)
            kernel[grid](*args, **meta)
        ctx.save_for_backward(q, k, v, gl, rho, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, gl, rho, lse = ctx.saved_tensors
        alert_not_deterministic("attention_backend=triton's backward", q.device)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dgl = None if gl is None else torch.zeros_like(gl)
        drho = None if rho is None else torch.zeros_like(rho)  # no queries: no gradient
        z, n_q = q.shape[:2]
        if z * n_q:
            grads, copies = (dq, dk, dv, q if dgl is None else dgl), gradient_copies(q, rho)
            kernel, grid, args, meta = backward_launch(grads, grad_out, lse, q, k, v, gl, rho,
                                                       *ctx.args, copies=copies)  # fmt: skip
            kernel[grid](*args, **meta)
            if rho is not None:  # the copies of drho, summed
                drho = args[4].sum(dim=0)
        return dq, dk, dv, dgl, drho, *(None,) * 7


def statistics(q, gl, rho, single: bool, n: int):
    """An empty tensor for the outer softmax's log-sum-exp, ``(Z, L, T, G)``, which the
    forward writes and the backward reads."""
    z, n_q, g, _ = q.shape
    return q.new_empty(z, n_q, _rows(single, rho, n, gl is not None and gl.dim() == 5), g)


def forward_launch(out, lse, q, k, v, gl, rho, *rest):
    """The forward kernel, its grid, arguments and keyword arguments (compile-time ones and
    launch options) for ``out`` ``(Z, L, V, d)`` and ``lse`` (:func:`statistics`); ``rest``:
    ``offsets, neighbour, valid, single, n, threshold, seed``."""
    program, args, meta = _program(q, k, v, gl, rho, *rest)
    return program.attention_forward, (q.shape[0] * q.shape[1],), (out, lse, *args), meta


def backward_launch(grads, grad_out, lse, q, k, v, gl, rho, *rest, copies: int = 1):
    """The backward kernel, its grid, arguments and keyword arguments, writing ``grads`` (dq,
    dk, dv, dgl: zeroed; a stand-in for an absent dgl) and, with a spatial term, ``copies``
    copies of drho (a new tensor ``(copies, V, D, e)``, argument 4, for the caller to sum)
    from ``grad_out`` ``(Z, L, V, d)`` and the forward's ``lse``."""
    program, args, meta = _program(q, k, v, gl, rho, *rest)
    if meta["BO"] == 1:  # every v had the same output row: their gradients add up
        grad_out = grad_out.sum(dim=2, keepdim=True)
    grad_out = grad_out.contiguous()
    dq, dk, dv, dgl = grads
    drho = q if rho is None else rho.new_zeros(copies, *rho.shape)
    args = (dq, dk, dv, dgl, drho, grad_out, lse, *args, grad_out.shape[2], copies)
    return program.attention_backward, (q.shape[0] * q.shape[1],), args, meta


def _program(q, k, v, gl, rho, offsets, neighbour, valid, single, n, threshold, seed):
    """The kernel module, the kernels' common arguments and their compile-time ones. Absent
    tensors are replaced by a stand-in that is never read."""
    gl_v = gl is not None and gl.dim() == 5
    sizes, blocks = _launch(q, k, rho, neighbour, single, n, threshold, seed, gl_v)
    args = (
        q, k, v, q if gl is None else gl, q if rho is None else rho,
        neighbour if offsets is None else offsets, neighbour,
        neighbour if valid is None else valid.view(torch.int8), *sizes,
    )  # fmt: skip
    flags = dict(
        HAS_GL=gl is not None, GL_V=gl_v, HAS_RHO=rho is not None, HAS_OFFSETS=offsets is not None,
        HAS_VALID=valid is not None, SINGLE=single, DROP=threshold > 0,
    )  # fmt: skip
    return kernels(), args, {**flags, **blocks, "num_warps": NUM_WARPS}


def triton_attention(q, k, v, gl, rho, offsets, neighbour, valid, single, n, threshold, seed):
    """The factorised attention (:mod:`symattn_cli.nn.gsa.core`) by the Triton kernel, without
    the 1 / (1 - drop) rescaling: ``(Z, L, V, d)``. ``gl`` ``(Z, L, M, G)``: the group logits,
    ``(Z, L, V, M, G)`` where they depend on the output element v (sum form only), or None;
    dropout keeps an entry whose 15-bit hash is at least ``threshold``. float32 or
    float64 CUDA tensors, or CPU tensors in Triton's interpreter."""
    if not available():
        raise ValueError(
            "attention backend 'triton' needs Triton, which ships with PyTorch's CUDA wheels "
            "(or pip install triton); use attention_backend=torch"
        )
    device = q.device
    if device.type != "cuda" and not (device.type == "cpu" and interpreted()):
        raise ValueError(
            f"attention backend 'triton' runs on CUDA tensors, not {device.type} ones (on the "
            f"CPU only in Triton's interpreter, {ENV}=1 before Triton is imported, which tests "
            "use); use attention_backend=auto or torch"
        )
    if q.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"attention backend 'triton' takes floating-point inputs, not {q.dtype}")
    if any(t is not None and t.dtype != q.dtype for t in (k, v, gl, rho)):
        raise ValueError("q, k, v and the encodings must share one dtype")

    if gl is not None and gl.dim() == 5 and (single or gl.shape[2] != n):
        raise ValueError(
            f"v-dependent group logits {tuple(gl.shape)} need the sum form and V = {n} rows"
        )

    def flat(t):
        return None if t is None else t.contiguous()

    q, k, v, gl, rho = (flat(t) for t in (q, k, v, gl, rho))
    args = (flat(offsets), flat(neighbour), flat(valid), single, n, threshold, seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            return TritonAttention.apply(q, k, v, gl, rho, *args)
    return TritonAttention.apply(q, k, v, gl, rho, *args)
