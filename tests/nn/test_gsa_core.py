"""The factorised attention core: gradients, agreement with the dense algorithm, stability."""

from __future__ import annotations

import threading

import pytest
import torch

from symattn_cli.nn.gsa_core import (
    FactorisedAttention,
    _keep_mask,
    _Packed,
    _Scratch,
    dense_attention,
    factorised_attention,
)


def _inputs(*, z=2, n_q=5, n_kv=7, j=4, g=3, m=3, n=3, d=5, e=2, local=True, seed=0):
    """Random core inputs in float64: every query sees ``j`` keys, the first one invalid; a
    group encoding on the channels after the spatial ones."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rnd(z, n_q, g, d), rnd(z, n_kv, m, d), rnd(z, n_kv, m, d)
    group_rho = rnd(g, m, d - e) if m > 1 else None  # on q's channels after rho's
    rho = rnd(n, j, e) if local else rnd(n, n_q, j, e)
    neighbour = torch.randint(0, n_kv, (n_q, j), generator=gen)
    valid = torch.ones(n_q, j, dtype=torch.bool)
    valid[::2, 0] = False  # some queries lose a neighbour
    return q, k, v, group_rho, rho, neighbour, valid


CASES = [
    ("sum", dict()),
    ("sum", dict(local=False)),
    ("single", dict()),
    ("single", dict(local=False)),
    ("sum", dict(g=1, m=1)),  # lifting
    ("sum", dict(g=5, m=5)),  # group products too large to pack (R8's are 8 x 8)
]


@pytest.mark.parametrize(("form", "shape"), CASES)
@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_gradcheck(form, shape, drop, loops):
    q, k, v, g_rho, rho, nb, valid = _inputs(**shape)
    n = rho.shape[0]

    def f(q, k, v, g_rho, rho):
        torch.manual_seed(0)  # the same dropout mask on every call
        return FactorisedAttention.apply(q, k, v, g_rho, rho, nb, valid, form, n, drop, 2, True, 0)

    args = [t.requires_grad_() if t is not None else None for t in (q, k, v, g_rho, rho)]
    assert torch.autograd.gradcheck(f, args)


def _dense(q, k, v, gl_rho, rho, nb, valid, form, n):
    return dense_attention(
        q, k, v, gl_rho, rho, nb, valid, form=form, n=n, dropout=torch.nn.Identity(), chunk=3
    )


@pytest.mark.parametrize(("form", "shape"), CASES)
def test_matches_dense_softmax(form, shape, loops):
    """Factorised (inner x outer softmax) = one softmax over the full (j, m) logits, values
    and gradients; the group term rides on the channels after the spatial ones."""
    q, k, v, table, rho, nb, valid = _inputs(**shape)
    n = rho.shape[0]
    fast_leaves = [t.clone().requires_grad_() for t in (q, k, v, rho)]
    dense_leaves = [t.clone().requires_grad_() for t in (q, k, v, rho)]
    if table is not None:  # rho_H(g^-1 m), say; the dense form takes one per v
        fast_leaves.append(table.clone().requires_grad_())
        dense_leaves.append(table.clone().requires_grad_())
    qf, kf, vf, rf = fast_leaves[:4]
    tf = fast_leaves[4] if table is not None else None
    fast = factorised_attention(qf, kf, vf, tf, rf, nb, valid, form=form, n=n, chunk=2)
    group_rho = dense_leaves[4].expand(n, *table.shape) if table is not None else None
    slow = _dense(*dense_leaves[:3], group_rho, dense_leaves[3], nb, valid, form, n)
    assert torch.allclose(fast, slow, atol=1e-12)
    weights = torch.randn_like(fast)
    (fast * weights).sum().backward()
    (slow * weights).sum().backward()
    for a, b in zip(fast_leaves, dense_leaves, strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["large", "very_negative"])
def test_logits_out_of_exp_range_fall_back_to_shifted_softmax(dtype, case, loops):
    """exp of the raw logits overflows (large) or underflows (very negative group term): the
    unshifted fast path detects it and the chunk is redone with maxima subtracted."""
    q, k, v, _, rho, nb, valid = _inputs()
    q, k, v, rho = (t.to(dtype) for t in (q, k, v, rho))
    table, group_rho = None, None
    if case == "large":
        q = q * 400.0  # |logits| ~ 1e3: exp overflows in float32 and float64
    else:  # every inner logit below -1000: exp underflows to zero
        q = torch.cat([q, torch.ones_like(q[..., :1])], dim=-1)
        k = torch.cat([k, torch.zeros_like(k[..., :1])], dim=-1)
        v = torch.cat([v, torch.zeros_like(v[..., :1])], dim=-1)
        table = torch.full((3, 3, 1), -1000.0, dtype=dtype)  # times the ones channel of q
        group_rho = table.double().expand(3, 3, 3, 1)  # the dense form: one per v
    out = factorised_attention(q, k, v, table, rho, nb, valid, form="sum", n=3, chunk=2)
    ref = _dense(q.double(), k.double(), v.double(), group_rho, rho.double(), nb, valid, "sum", 3)
    assert torch.isfinite(out).all()
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert torch.allclose(out.double(), ref, atol=tol * ref.abs().max())


def test_dropout_rate_and_identity_without_dropout():
    keep = _keep_mask((1000, 1000), 0.1, 3, _Scratch(torch.empty(0), reuse=False))
    assert abs(1.0 - keep.double().mean().item() - 0.1) < 2e-3  # 1e6 draws: std 3e-4
    assert _keep_mask((10,), 0.0, 3, _Scratch(torch.empty(0), reuse=True)).bool().all()
    q, k, v, g_rho, rho, nb, valid = _inputs()
    torch.manual_seed(1)
    a = factorised_attention(q, k, v, g_rho, rho, nb, valid, form="sum", n=3, drop=0.5, chunk=2)
    b = factorised_attention(q, k, v, g_rho, rho, nb, valid, form="sum", n=3, chunk=2)
    assert not torch.allclose(a, b)  # dropout changes the output ...
    torch.manual_seed(1)
    c = factorised_attention(q, k, v, g_rho, rho, nb, valid, form="sum", n=3, drop=0.5, chunk=2)
    assert torch.equal(a, c)  # ... reproducibly from the seed


def test_bad_arguments():
    q, k, v, g_rho, rho, nb, valid = _inputs()
    with pytest.raises(ValueError, match="form='x'"):
        factorised_attention(q, k, v, g_rho, rho, nb, valid, form="x", n=3, chunk=2)
    with pytest.raises(ValueError, match="dropout 1.0"):
        factorised_attention(q, k, v, g_rho, rho, nb, valid, form="sum", n=3, drop=1.0, chunk=2)


@pytest.mark.parametrize("form", ["sum", "single"])
def test_cpu_workers_give_the_same_values_and_gradients(form, monkeypatch, cpu_loops):
    """Chunks shared among worker threads: same outputs, gradients and dropout masks."""
    import symattn_cli.nn.gsa_core as core

    q, k, v, g_rho, rho, nb, valid = _inputs(n_q=9)

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g_rho, rho)]
        torch.manual_seed(3)
        out = factorised_attention(*leaves, nb, valid, form=form, n=3, drop=0.2, chunk=2)
        out.square().sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = run()
        torch.set_num_threads(3)
        monkeypatch.setattr(core, "MIN_PARALLEL_WORK", 0)
        parallel = run()
        assert torch.get_num_threads() == 3  # restored after the workers ran
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(serial, parallel, strict=True):
        assert torch.allclose(a, b, atol=1e-13)


def test_explicit_attention_threads_work_whatever_torch_threads(monkeypatch, cpu_loops):
    """``threads=3`` shares the chunks among three threads (the caller and two pool workers)
    even with one torch thread (and below MIN_PARALLEL_WORK); values and gradients equal the
    serial ones; negative is an error."""
    import symattn_cli.nn.gsa_core as core

    q, k, v, g_rho, rho, nb, valid = _inputs(n_q=9)
    names = []

    def run(threads):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g_rho, rho)]
        torch.manual_seed(3)
        out = factorised_attention(
            *leaves, nb, valid, form="sum", n=3, drop=0.2, chunk=2, threads=threads
        )
        out.square().sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    real_chunk, real_loops = core._Chunk, core._native_loops

    def spy(*args, **kwargs):
        names.append(threading.current_thread().name)
        return real_chunk(*args, **kwargs)

    class SpiedLoops:  # the C++ loops, noting the threads that call them
        def __init__(self, module):
            self.module = module

        def forward_chunks(self, *args):
            names.append(threading.current_thread().name)
            return self.module.forward_chunks(*args)

        def backward_chunks(self, *args):
            names.append(threading.current_thread().name)
            return self.module.backward_chunks(*args)

    def spied_loops(q):
        module = real_loops(q)
        return None if module is None else SpiedLoops(module)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = run(1)
        monkeypatch.setattr(core, "_Chunk", spy)
        monkeypatch.setattr(core, "_native_loops", spied_loops)
        parallel = run(3)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    # three threads ran the chunks: this one and two pool workers
    assert len(set(names)) == 3 and threading.current_thread().name in names, names
    assert sum(n.startswith("gsa-core") for n in set(names)) == 2, names
    for a, b in zip(serial, parallel, strict=True):
        assert torch.allclose(a, b, atol=1e-13)
    with pytest.raises(ValueError, match="threads=-1"):
        factorised_attention(q, k, v, g_rho, rho, nb, valid, form="sum", n=3, chunk=2, threads=-1)


@pytest.mark.parametrize(("form", "shape"), CASES)
def test_backward_takes_a_non_contiguous_output_gradient(form, shape, loops):
    """The layer's W_out hands back a permuted gradient; the result must not depend on it."""
    q, k, v, g_rho, rho, nb, valid = _inputs(**shape)
    q.requires_grad_()
    out = factorised_attention(q, k, v, g_rho, rho, nb, valid, form=form, n=rho.shape[0], chunk=1)
    z, n_q, n, d = out.shape
    grad = torch.randn(z, d, n, n_q, dtype=out.dtype).permute(0, 3, 2, 1)  # as from W_out
    (a,) = torch.autograd.grad(out, q, grad, retain_graph=True)
    (b,) = torch.autograd.grad(out, q, grad.contiguous())
    assert not grad.is_contiguous() and torch.equal(a, b)


@pytest.mark.parametrize(
    ("n", "r", "c", "d", "strided"),
    [(12, 4, 4, 6, True), (12, 4, 4, 6, False), (11, 4, 4, 6, False), (8, 2, 2, 3, True),
     (6, 3, 5, 2, False), (4, 8, 8, 8, False)],
)  # fmt: skip
@pytest.mark.parametrize("reuse", [False, True])
def test_packed_small_products_equal_bmm(n, r, c, d, strided, reuse):
    """Tiny products packed into block-diagonal matrices give torch.bmm's result, for a and
    its transpose, also when the thread's workspace already held other blocks (odd batch
    sizes and large products take torch.bmm itself)."""
    gen = torch.Generator().manual_seed(n + r + c + d)
    for _ in range(2):  # the second round packs into the first round's workspace
        a = torch.randn(n, c, r, generator=gen, dtype=torch.float64).transpose(1, 2)
        if not strided:
            a = a.contiguous()
        b = torch.randn(n, c, d, generator=gen, dtype=torch.float64)
        b_t = torch.randn(n, r, d, generator=gen, dtype=torch.float64)
        packed = _Packed(a, d, _Scratch(a, reuse))
        result = packed.bmm(b, torch.empty(n, r, d, dtype=a.dtype))
        torch.testing.assert_close(result, torch.bmm(a, b), rtol=1e-15, atol=1e-15)
        result = packed.bmm(b_t, torch.empty(n, c, d, dtype=a.dtype), transpose=True)
        expected = torch.bmm(a.transpose(1, 2), b_t)
        torch.testing.assert_close(result, expected, rtol=1e-15, atol=1e-15)
        mask = (torch.rand(n, r, c, generator=gen) < 0.7).to(a.dtype)  # dropout on the way in
        masked = _Packed(a, d, _Scratch(a, reuse), mask)
        result = masked.bmm(b, torch.empty(n, r, d, dtype=a.dtype))
        torch.testing.assert_close(result, torch.bmm(a * mask, b), rtol=1e-15, atol=1e-15)


def test_inference_keeps_no_chunks_training_keeps_them(monkeypatch):
    """Without a backward to come, chunks are dropped as soon as their output is written (peak
    memory: one chunk); with one and ``recompute=False`` every chunk is kept for it. (The
    Python loops' chunks; the C++ loops' kept chunks are compared in test_gsa_native.)"""
    import weakref

    import symattn_cli.nn.gsa_core as core

    monkeypatch.setattr(core, "NATIVE", False)

    q, k, v, g_rho, rho, nb, valid = _inputs(n_q=6)
    alive: weakref.WeakSet = weakref.WeakSet()
    peak = [0]

    class Counted(core._Chunk):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            alive.add(self)
            peak[0] = max(peak[0], len(alive))

    monkeypatch.setattr(core, "_Chunk", Counted)
    args = dict(form="sum", n=3, chunk=1, recompute=False, threads=1)
    with torch.no_grad():
        factorised_attention(q, k, v, g_rho, rho, nb, valid, **args)
    assert peak[0] <= 2  # the next chunk exists before the previous one is released
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g_rho, rho)]
    out = factorised_attention(*leaves, nb, valid, **args)
    assert len(alive) == 6  # one per query, for the backward
    out.sum().backward()
    assert len(alive) == 0


def test_chunks_reuse_the_thread_scratch_and_output_is_laid_out_for_w_out(monkeypatch):
    """A second forward and backward allocates no new chunk buffers (the scratch only grows
    to the largest chunk, then is reused), and the output is stored as (Z, d, V, L). (The
    Python loops' scratch; the C++ loops keep theirs the same way.)"""
    import symattn_cli.nn.gsa_core as core

    monkeypatch.setattr(core, "NATIVE", False)

    q, k, v, g_rho, rho, nb, valid = _inputs(n_q=9)
    args = dict(form="sum", n=3, drop=0.2, chunk=2, threads=1)

    def step():
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g_rho, rho)]
        out = factorised_attention(*leaves, nb, valid, **args)
        out.square().sum().backward()
        return out

    out = step()
    assert out.permute(0, 3, 2, 1).is_contiguous()  # (Z, L, V, d) viewed from (Z, d, V, L)
    buffers = {key: buf.data_ptr() for key, buf in core._LOCAL.scratch[0].items()}
    assert {"k_nb", "v_nb", "c", "w", "t", "keep"} <= {key[0] for key in buffers}
    step()
    assert {key: buf.data_ptr() for key, buf in core._LOCAL.scratch[0].items()} == buffers


def test_plain_products_give_the_same_values_and_restore_the_settings():
    """Packing and 0/1-matrix sums are implementation choices: switching them off (as the FLOP
    counter does) changes no value or gradient beyond rounding."""
    import symattn_cli.nn.gsa_core as core

    q, k, v, g_rho, rho, nb, valid = _inputs(n_q=9, g=4, m=4, n=4, j=6)  # packed: 4 x 4 blocks

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g_rho, rho)]
        out = factorised_attention(*leaves, nb, valid, form="sum", n=4, chunk=3, threads=1)
        out.square().sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    settings = (core.PACKED_ROWS, core.GEMM_SUM_MAX, core.GEMM_SCALE_MAX)
    fast = run()
    with core.plain_products():
        assert (core.PACKED_ROWS, core.GEMM_SUM_MAX, core.GEMM_SCALE_MAX) == (1, 0, 0)
        plain = run()
    assert (core.PACKED_ROWS, core.GEMM_SUM_MAX, core.GEMM_SCALE_MAX) == settings
    for a, b in zip(fast, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_autocast_check_knows_devices_without_autocast():
    from symattn_cli.nn.gsa_core import _autocast_on

    assert _autocast_on("meta") is False  # torch raises for it; the core must not
    assert _autocast_on("cpu") is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _autocast_on("cpu") is True
