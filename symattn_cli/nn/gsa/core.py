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
The reference's (V, G, J, M) logits per query never exist.

A group index that sees v (``pair``, ``gevit``, ``shifted``; not ``relative``, g^-1 m;
:mod:`.layer`) gives group logits gl[v, m, g], so pi, lse and beta carry v too: pi[v, j, m, g] =
softmax_m(c + gl[v]) and beta = softmax_j(s[v] + lse[v]). The probabilities are then mixed
over g before the values,

    P[v, j, m] = sum_g beta[v, j, g] pi[v, j, m, g]
    out(i, v)  = sum_(j, m) P[v, j, m] val[j, m]

so the value work is one weighted sum per (v, key), not one per (v, g, key).

The "single" form has one query per output element (g = v): out(i, g) = sum_j beta[j, g]
W[j, g], with s[j, g] and gl taken at v = g. Lifting is the sum form with G = M = 1 (pi = 1).
Neighbours outside the image (``valid`` false) get beta = 0. The spatial encoding is a table
``rho (V, D, e)`` over distinct offsets, indexed per (query, neighbour) by ``offsets (L, J)``
(None when local: D = J, the same for every query).

Attention dropout zeroes entries of pi (shared by every v) by a keep mask that is a hash of
(seed, z, i, j, m, g) (:func:`~symattn_cli.nn.gsa.common.keep_mask`): every backend draws the
same mask, in any order, and the backward redraws it instead of storing it.

Backends (:data:`symattn_cli.options.BACKENDS`), one file each in this package, named after
the option that picks it; this file (the dispatcher, :func:`factorised_attention`,
``backend="auto"``) hands them plain tensors and values, and none imports it:
  ``cpp``     (:mod:`.cpp`, ``cpp_kernel.cpp``) the fused CPU kernel: per tile of queries,
              logits, both softmaxes and the value sums in cache, the group logits gathered
              from q . emb[r] (G R per query) by the index, never as a (V, M, G) tensor per
              query; a hand-written backward that recomputes them.
  ``triton``  (:mod:`.triton`, :mod:`.triton_kernel`) the fused GPU kernel: one program per
              query, the same equations, its backward recomputing them from the outer
              softmax's log-sum-exp that the forward keeps; CUDA tensors (CPU tensors only in
              Triton's interpreter, ``TRITON_INTERPRET=1``, for tests); auto's choice on CUDA
              for lifting layers.
  ``triton_tiles`` (:mod:`.triton_tiles`, :mod:`.triton_tiles_kernel`) the GPU kernel
              reshaped: a tile of queries a program over their neighbours' halo, both
              products as matrix products (``tl.dot``), the group logits formed in the kernel
              from the encoding; on the same devices as ``triton``; auto's choice on CUDA
              for group layers.
  ``torch``   (:mod:`.torch`) the same algorithm in plain PyTorch over chunks of queries, each
              recomputed in the backward (activation checkpointing): any device.
:func:`~symattn_cli.nn.gsa.dense.dense_attention` (:mod:`.dense`) is the reference algorithm
(full logits, autograd), the test oracle. :mod:`.common` holds the dropout mask and the spatial
table lookup that every backend shares.

Measuring code reads and steers the dispatcher through two context managers instead of
replacing its functions or the layers' attributes: :func:`recording` hands over each call
(:class:`AttentionCall`: the backend that runs it, its arguments), and :func:`overriding`
makes the calls in its block run another backend or recompute setting. Neither costs more
than one context-variable read per call when none is active.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

import torch

from symattn_cli.nn.gsa import cpp, triton, triton_tiles
from symattn_cli.nn.gsa.common import DROP_STEPS, deterministic_mode
from symattn_cli.nn.gsa.torch import torch_attention
from symattn_cli.options import BACKENDS
from symattn_cli.options import QUERY_FORMS as FORMS


def group_logits(q: torch.Tensor, group_rho: torch.Tensor | None, single: bool = False):
    """The group logits over q's last c channels, or None without a group encoding.

    ``group_rho`` ``(G, M, c)``, an encoding of the key's element relative to the query's
    (rho_H(g^-1 m)): gl[m, g] = q_ig . group_rho[g, m], ``(Z, L, M, G)``. ``group_rho``
    ``(V, G, M, c)``, an encoding that also sees the output element: gl[v, m, g] = q_ig .
    group_rho[v, g, m], ``(Z, L, V, M, G)``; in the single form (g = v) only its diagonal is
    read, ``(Z, L, M, G)``."""
    if group_rho is None:
        return None
    c = group_rho.shape[-1]
    tail = q[..., q.shape[-1] - c :]  # (Z, L, G, c)
    if group_rho.dim() == 4:
        if not single:
            return torch.einsum("zlgc,vgmc->zlvmg", tail, group_rho).contiguous()
        group_rho = torch.diagonal(group_rho, dim1=0, dim2=1).permute(2, 0, 1)  # (G, M, c)
    return torch.einsum("zlgc,gmc->zlmg", tail, group_rho).contiguous()


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return False


def _widen(t: torch.Tensor | None) -> torch.Tensor | None:
    """float16 / bfloat16 -> float32 (what autocast hands over); anything else as it is."""
    return t.float() if t is not None and t.dtype in (torch.float16, torch.bfloat16) else t


def backend_for(device, dtype=torch.float32, backend: str = "auto", grouped: bool = True) -> str:
    """The backend a call on ``device`` with ``dtype`` runs: ``backend`` itself, or for
    ``"auto"`` on CUDA with Triton installed the tiled Triton kernel for a group layer
    (``grouped``: G or M > 1) and the one-query-a-program kernel for a lifting layer, the
    faster of the two for each on a GPU (docs/benchmark.md), except under torch's strict
    deterministic mode (``torch.use_deterministic_algorithms(True)`` without ``warn_only``),
    where, as torch's own operations with a deterministic twin do, it takes ``"torch"``
    (the Triton backwards' atomic adds would raise); the fused CPU kernel where it applies
    and is built; else ``"torch"``."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}; choose one of {BACKENDS}")
    if backend != "auto":
        return backend
    device = torch.device(device)
    if device.type == "cuda" and triton.available() and deterministic_mode() != "strict":
        return "triton_tiles" if grouped else "triton"
    if device.type == "cpu" and dtype in (torch.float32, torch.float64) and cpp.available():
        return "cpp"
    return "torch"


def attention_backends(model: Any, device) -> str:
    """The backends the attention layers of ``model`` run on ``device``, comma-separated and
    sorted ("" when it has none); ``dense`` for a layer that runs the reference algorithm."""
    backends = {
        m.attention_backend if m.attention_backend == "dense" else
        backend_for(device, backend=m.attention_backend, grouped=not getattr(m, "lifting", False))
        for m in model.modules()
        if hasattr(m, "attention_backend")
    }  # fmt: skip
    return ",".join(sorted(backends))


# ---------------------------------------------------------------- hooks for measuring


@dataclass(frozen=True)
class AttentionCall:
    """One call of the attention core, as :func:`factorised_attention` received it (after
    autocast's widening to float32, where autocast is on) and before it runs.

    ``backend``: the backend that runs it (auto's choice made, an :func:`overriding` applied);
    ``q`` ``(Z, L, G, d)`` (scaled), ``k``, ``v`` ``(Z, Lkv, M, d)``; ``group_rho`` ``(G, M,
    c)``, ``(V, G, M, c)``, or with ``group_index`` ``(G, M)`` / ``(V, G, M)`` the embedding
    table ``(R, c)`` (:attr:`encoding` gives the encoding either way), or None; ``rho`` ``(V,
    D, e)`` or None; ``offsets`` ``(L, J)`` or None; ``neighbour`` ``(L, J)``; ``valid`` ``(L,
    J)`` or None; ``form``, ``n`` = V, ``drop`` as given (before rounding to a multiple of
    2^-15), ``chunk``, and ``recompute`` after an :func:`overriding`. The tensors are the
    call's own, not copies."""

    backend: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    group_rho: torch.Tensor | None
    rho: torch.Tensor | None
    offsets: torch.Tensor | None
    neighbour: torch.Tensor
    valid: torch.Tensor | None
    form: str
    n: int
    drop: float
    chunk: int
    recompute: bool
    group_index: torch.Tensor | None

    @property
    def encoding(self) -> torch.Tensor | None:
        """The group encoding ``(G, M, c)`` or ``(V, G, M, c)``: ``group_rho`` read at
        ``group_index`` when the call gave an index, else ``group_rho`` itself (or None)."""
        if self.group_rho is not None and self.group_index is not None:
            return self.group_rho[self.group_index]
        return self.group_rho


@dataclass(frozen=True)
class _Hooks:
    """What the active :func:`recording` and :func:`overriding` blocks ask of each call."""

    recorders: tuple[Callable[[AttentionCall], None], ...] = ()
    run: bool = True  # False: zeros stand in for the output
    backend: str | None = None  # None: the caller's
    recompute: bool | None = None  # None: the caller's


# One value per thread (and per asyncio task): a block sees the calls made in its own thread.
# None when no block is active, so that a call pays a single read.
_HOOKS: ContextVar[_Hooks | None] = ContextVar("symattn_attention_hooks", default=None)


@contextlib.contextmanager
def _hooked(**changes: Any) -> Iterator[None]:
    token = _HOOKS.set(replace(_HOOKS.get() or _Hooks(), **changes))
    try:
        yield
    finally:
        _HOOKS.reset(token)


@contextlib.contextmanager
def recording(
    callback: Callable[[AttentionCall], None] | None = None, *, run: bool = True
) -> Iterator[list[AttentionCall]]:
    """Record the attention core's calls made in this thread inside the block.

    Yields a list that receives one :class:`AttentionCall` per call of
    :func:`factorised_attention`, in the order the calls are made (a model's attention
    layers in the order its forward runs them), each appended as the call starts, before the
    backend runs; ``callback``, if given, is also called with each. The torch backend's
    recomputation in the backward is not a call of the core and is not recorded.

    ``run=False``: the backend is not run: zeros ``(Z, L, V, d)`` of q's dtype stand in for
    the output, and no dropout seed is drawn (torch's generator is left as it was); for
    reading the calls' sizes without their cost.

    Blocks nest: every active recording sees each call (the outer one's callback first), and
    the core is skipped while any of them has ``run=False``. Leaving the block, also by an
    exception, restores what was active before. Calls made in other threads are not
    recorded (the state lives in a context variable)."""
    calls: list[AttentionCall] = []

    def record(call: AttentionCall) -> None:
        calls.append(call)
        if callback is not None:
            callback(call)

    hooks = _HOOKS.get() or _Hooks()
    with _hooked(recorders=(*hooks.recorders, record), run=hooks.run and run):
        yield calls


@contextlib.contextmanager
def overriding(backend: str | None = None, *, recompute: bool | None = None) -> Iterator[None]:
    """Run the attention core's calls made in this thread inside the block on ``backend``
    (one of :data:`BACKENDS`; ``"auto"`` chooses per call as :func:`backend_for` does) and
    with ``recompute`` (the torch backend's recomputation in the backward), whatever the
    caller (a layer's ``attention_backend`` and ``checkpointing``) asked for; None keeps the
    caller's (or an enclosing block's) choice. A layer with ``attention_backend="dense"``
    does not call the core and runs the reference algorithm still. Leaving the block, also by
    an exception, restores what was active before."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}; choose one of {BACKENDS}")
    hooks = _HOOKS.get() or _Hooks()
    with _hooked(
        backend=hooks.backend if backend is None else backend,
        recompute=hooks.recompute if recompute is None else recompute,
    ):
        yield


def factorised_attention(
    q, k, v, group_rho, rho, offsets, neighbour, valid, *, form: str, n: int,
    drop: float = 0.0, chunk: int = 64, recompute: bool = True, backend: str = "auto",
    group_index: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``out (Z, L, V, d)`` from q ``(Z, L, G, d)`` (pre-scaled by 1/sqrt(d)), k, v
    ``(Z, Lkv, M, d)``.

    ``group_rho`` ``(G, M, c)``, ``(V, G, M, c)`` or None: the group encoding, dotted with
    q's last c channels (:func:`group_logits`); with ``group_index`` ``(G, M)`` or ``(V, G,
    M)`` (int64), ``group_rho`` is the embedding table ``(R, c)`` and the encoding is
    ``group_rho[group_index]`` (the fused CPU kernel gathers the logits by the index, never
    building the ``(Z, L, V, M, G)`` tensor);
    ``rho`` ``(V, D, e)`` or None: rho_xy, dotted with q's first e channels, at offset
    ``offsets[i, j]`` ``(L, J)`` (None: local, offset j); ``neighbour`` ``(L, J)`` indices
    into Lkv; ``valid`` ``(L, J)`` bool or None; ``n`` = V; ``drop`` the attention-dropout
    rate (a multiple of 2^-15 after rounding; the output is rescaled by 1 / (1 - drop));
    ``chunk`` queries per chunk of the torch backend, and ``recompute`` whether it recomputes
    them in the backward (the fused kernels always do); ``backend`` one of :data:`BACKENDS`.
    An :func:`overriding` block replaces ``backend`` and ``recompute``; a :func:`recording`
    block receives the call.

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
                chunk=chunk, recompute=recompute, backend=backend, group_index=group_index,
            )  # fmt: skip
    # a recording or overriding block is active (eager only: torch.compile traces past them)
    hooks = None if torch.compiler.is_compiling() else _HOOKS.get()
    if hooks is not None:
        backend = hooks.backend or backend
        recompute = recompute if hooks.recompute is None else hooks.recompute
    which = backend_for(q.device, q.dtype, backend, grouped=q.shape[2] > 1 or k.shape[2] > 1)
    if hooks is not None:
        if hooks.recorders:
            call = AttentionCall(which, q, k, v, group_rho, rho, offsets, neighbour, valid,
                                 form, n, drop, chunk, recompute, group_index)  # fmt: skip
            for record in hooks.recorders:
                record(call)
        if not hooks.run:
            return q.new_zeros(q.shape[0], q.shape[1], n, q.shape[3])
    threshold = round(drop * DROP_STEPS)
    drop = threshold / DROP_STEPS
    # One seed per call, drawn from torch's generator: torch.manual_seed fixes the masks.
    seed = (
        torch.randint(1 << 62, (), device="cpu") if drop > 0 else torch.zeros((), dtype=torch.int64)
    )
    single = form == "single"
    if which == "cpp":  # the kernel gathers the group logits from a table and an index
        if group_rho is not None and group_index is None:  # every (v, g, m) its own row
            group_index = torch.arange(group_rho[..., 0].numel()).view(group_rho.shape[:-1])
            group_rho = group_rho.reshape(-1, group_rho.shape[-1])
        return cpp.cpp_attention(q, k, v, group_rho, group_index, rho, offsets, neighbour,
                                 valid, single, n, threshold, seed)  # fmt: skip
    seed = int(seed)
    if group_rho is not None and group_index is not None:
        group_rho = group_rho[group_index]
    # the tiled kernel forms the group logits from the encoding; the others take them
    group = group_rho if which == "triton_tiles" else group_logits(q, group_rho, single)
    if which == "torch":
        out = torch_attention(q, k, v, group, rho, offsets, neighbour, valid, single, n,
                              threshold, seed, max(int(chunk), 1), recompute)  # fmt: skip
    else:  # a Triton kernel; half precision is computed in float32
        kernel = triton.triton_attention if which == "triton" else triton_tiles.tiled_attention
        wide = (_widen(t) for t in (q, k, v, group, rho))
        out = kernel(*wide, offsets, neighbour, valid, single, n, threshold, seed).to(q.dtype)
    return out * (1.0 / (1.0 - drop)) if drop > 0 else out
