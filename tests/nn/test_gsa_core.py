"""The attention core: each backend against the dense oracle (values and gradients, dropout
masks included), gradients, stability, threads, dropout, arguments."""

from __future__ import annotations

import math

import pytest
import torch

import symattn_cli.nn.gsa.core as core
from symattn_cli.nn.gsa.common import keep_mask
from symattn_cli.nn.gsa.core import factorised_attention
from symattn_cli.nn.gsa.dense import dense_attention
from tests.helpers import threads


def _inputs(*, z=2, n_q=5, n_kv=7, j=4, g=3, m=3, n=None, d=5, e=2, local=True, seed=0, by_v=False):
    """Random core inputs in float64: every query sees ``j`` keys, the first one invalid for
    every other query; a group encoding on the channels after the spatial ones, ``(V, G, M,
    c)`` (one that sees the output element) when ``by_v``; a global spatial table of 6
    distinct offsets, or a local one per neighbour."""
    gen = torch.Generator().manual_seed(seed)
    n = n or g if g > 1 else 3

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rnd(z, n_q, g, d), rnd(z, n_kv, m, d), rnd(z, n_kv, m, d)
    group_rho = None
    if m > 1:  # on q's channels after rho's
        group_rho = rnd(n, g, m, d - e) if by_v else rnd(g, m, d - e)
    rho, offsets = (rnd(n, j, e), None) if local else (rnd(n, 6, e), torch.randint(0, 6, (n_q, j)))
    rho = rho if e else None
    neighbour = torch.randint(0, n_kv, (n_q, j), generator=gen)
    valid = torch.ones(n_q, j, dtype=torch.bool)
    valid[::2, 0] = False  # some queries lose a neighbour
    return q, k, v, group_rho, rho, offsets, neighbour, valid, n


CASES = [
    ("sum", dict()),
    ("sum", dict(local=False)),
    ("single", dict()),
    ("single", dict(local=False)),
    ("sum", dict(g=1, m=1)),  # lifting
    ("sum", dict(g=1, m=1, local=False)),
    ("sum", dict(g=8, m=8, d=7, e=4)),  # R8-sized group axes
    ("sum", dict(e=0)),  # no spatial term: the same output for every v
    ("single", dict(e=0)),
    ("sum", dict(z=3, n_q=7, j=9)),  # counts that divide nothing
    ("sum", dict(by_v=True)),  # a group term that sees v (group_index pair, gevit, shifted)
    ("sum", dict(by_v=True, local=False)),
    ("single", dict(by_v=True)),
    ("sum", dict(g=8, m=8, d=7, e=4, by_v=True)),
    ("sum", dict(e=0, by_v=True)),
    # contractions over more than 256 (j, m) or (j, g): the kernel takes them in passes
    ("sum", dict(n_kv=48, j=40, g=2, m=8, by_v=True, local=False)),
    ("sum", dict(n_kv=48, j=40, g=8, m=2, local=False)),
    # R4-sized group axes (the C++ kernel's loops take 4 and 8 as compile-time sizes)
    ("sum", dict(g=4, m=4, d=6, e=2, by_v=True)),
    ("single", dict(g=4, m=4, d=6, e=2)),
]


def _run(fn, inputs, form, dtype=torch.float64, seed=0, **kwargs):
    """``[out, grads of q, k, v, group_rho, rho]`` of a random weighted sum of the output."""
    q, k, v, group_rho, rho, offsets, nb, valid, n = inputs
    # detached copies: each call's gradients are its own, not added to an earlier call's
    leaves = [None if t is None else t.detach().to(dtype).requires_grad_()
              for t in (q, k, v, group_rho, rho)]  # fmt: skip
    torch.manual_seed(seed)
    out = fn(*leaves, offsets, nb, valid, form=form, n=n, **kwargs)
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.device, dtype)
    (out * weights).sum().backward()
    return [out.detach()] + [t.grad for t in leaves if t is not None]


def _dense(drop: float, seed: int = 0):
    """The oracle with the mask the core draws after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    mask_seed = int(torch.randint(1 << 62, ())) if drop > 0 else 0

    def fn(*args, **kwargs):
        return dense_attention(*args, **kwargs, drop=drop, seed=mask_seed, chunk=3)

    return fn


@pytest.mark.parametrize(("form", "shape"), CASES)
@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_matches_the_dense_oracle(form, shape, drop, backend):
    """Factorised (inner x outer softmax) = one softmax over the full (j, m) logits: values and
    gradients to float64 round-off, with the same dropout masks."""
    inputs = _inputs(**shape)
    ours = _run(factorised_attention, inputs, form, drop=drop, chunk=2, backend=backend)
    oracle = _run(_dense(drop), inputs, form)
    assert len(ours) == len(oracle)
    for a, b in zip(ours, oracle, strict=True):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max()


@pytest.mark.parametrize(("form", "shape"), CASES[:5] + CASES[10:13])
def test_float32_matches_the_float64_oracle(form, shape, backend):
    inputs = _inputs(**shape)
    ours = _run(factorised_attention, inputs, form, torch.float32, drop=0.2, backend=backend)
    oracle = _run(_dense(0.2), inputs, form)
    for a, b in zip(ours, oracle, strict=True):
        assert a.dtype == torch.float32
        assert (a.double() - b).abs().max() <= 2e-5 * b.abs().max()


@pytest.mark.parametrize(("form", "shape"), [CASES[0], CASES[3], CASES[4], CASES[7], CASES[10]])
def test_gradcheck(form, shape, backend):
    q, k, v, g_rho, rho, offsets, nb, valid, n = _inputs(z=1, n_q=3, **shape)

    def f(*leaves):
        it = iter(leaves)
        args = [None if t is None else next(it) for t in (q, k, v, g_rho, rho)]
        torch.manual_seed(0)  # the same dropout mask on every call
        return factorised_attention(
            *args, offsets, nb, valid, form=form, n=n, drop=0.25, chunk=2, backend=backend
        )

    leaves = [t.requires_grad_() for t in (q, k, v, g_rho, rho) if t is not None]
    assert torch.autograd.gradcheck(f, leaves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["large", "very_negative"])
def test_logits_far_outside_exp_range_stay_finite(dtype, case, backend):
    """Logits of order 1e3 (exp overflows) or a group term of -1e3 (exp underflows): both
    softmaxes subtract their maxima, and the result matches the float64 oracle."""
    q, k, v, _, rho, offsets, nb, valid, n = _inputs()
    table = None
    if case == "large":
        q = q * 400.0
    else:  # every inner logit below -1000
        q = torch.cat([q, torch.ones_like(q[..., :1])], dim=-1)
        k = torch.cat([k, torch.zeros_like(k[..., :1])], dim=-1)
        v = torch.cat([v, torch.zeros_like(v[..., :1])], dim=-1)
        table = torch.full((3, 3, 1), -1000.0, dtype=torch.float64)  # on q's ones channel
    args = (q, k, v, table, rho, offsets, nb, valid)
    out = factorised_attention(
        *(t.to(dtype) if t is not None and t.is_floating_point() else t for t in args),
        form="sum", n=n, backend=backend,
    )  # fmt: skip
    ref = dense_attention(*args, form="sum", n=n)
    assert torch.isfinite(out).all()
    # float32: q's gradient sums terms of the logits' size (100) to a result of order 1
    tol = 1e-3 if dtype == torch.float32 else 1e-10
    assert (out.double() - ref).abs().max() <= tol * ref.abs().max()


def opposed_inputs(dtype) -> tuple:
    """Core inputs whose key logits favour key element 0 and whose v-dependent group term
    favours element 1, each by more than exp's range in ``dtype`` (100 for float32, 1000 for
    float64)."""
    q, k, v, g_rho, rho, offsets, nb, valid, n = _inputs(by_v=True, local=False)
    far = torch.zeros(k.shape[2], dtype=torch.float64)
    far[0] = 100.0 if dtype == torch.float32 else 1000.0
    q = torch.cat([q, torch.ones_like(q[..., :1])], dim=-1)  # an extra channel of ones ...
    k = torch.cat([k, far.expand(*k.shape[:3])[..., None]], dim=-1)  # ... +far on m = 0
    v = torch.cat([v, torch.zeros_like(v[..., :1])], dim=-1)
    g_rho = torch.cat([g_rho, far.roll(1).expand(*g_rho.shape[:3])[..., None]], dim=-1)  # m = 1
    return q, k, v, g_rho, rho, offsets, nb, valid, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_term_that_sees_v_against_key_logits_far_the_other_way(dtype, backend):
    """The key logits favour key element 0 and a v-dependent group term element 1, each by
    more than exp's range (100 for float32, 1000 for float64): exp of each part underflows
    where exp of their sum does not. Values and gradients still match the float64 oracle."""
    check_opposed(dtype, backend)


def check_opposed(dtype, backend: str, device: str = "cpu") -> None:
    """Values and gradients of ``backend`` on :func:`opposed_inputs` on ``device``, with
    dropout, match the float64 oracle."""
    inputs = tuple(t.to(device) if torch.is_tensor(t) else t for t in opposed_inputs(dtype))
    ours = _run(factorised_attention, inputs, "sum", dtype, drop=0.2, backend=backend)
    oracle = _run(_dense(0.2), inputs, "sum")
    # float32: q's gradient sums terms of the logits' size (100) to a result of order 1
    tol = 1e-3 if dtype == torch.float32 else 1e-10
    for a, b in zip(ours, oracle, strict=True):
        assert torch.isfinite(a).all()
        assert (a.double() - b).abs().max() <= tol * b.abs().max()


def test_the_kernel_itself_takes_a_group_term_that_sees_v(monkeypatch, kernel):
    """A (V, G, M, c) group encoding runs on the fused kernel, not handed to the torch backend
    (which refuses here), and matches the oracle."""

    def refuse(*args, **kwargs):
        raise AssertionError("handed to the torch backend")

    monkeypatch.setattr(core, "torch_attention", refuse)
    inputs = _inputs(by_v=True)
    with pytest.raises(AssertionError, match="torch backend"):  # the refusal is in place
        _run(factorised_attention, inputs, "sum", backend="torch")
    ours = _run(factorised_attention, inputs, "sum", drop=0.3, backend="cpp")
    oracle = _run(_dense(0.3), inputs, "sum")
    for a, b in zip(ours, oracle, strict=True):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max()


def test_backends_draw_the_same_dropout_mask_at_the_set_rate(kernel):
    keep = keep_mask(3, (10, 100, 25, 4, 4), slice(0, 100), 0.1, "cpu")
    assert abs(1.0 - keep.double().mean().item() - 0.1) < 2e-3  # 4e6 draws: std 1.5e-4
    part = keep_mask(3, (10, 100, 25, 4, 4), slice(40, 60), 0.1, "cpu")
    assert torch.equal(part, keep[:, 40:60])  # a chunk's mask is its rows of the call's
    assert keep_mask(3, (2, 5, 3, 2, 2), slice(0, 5), 0.0, "cpu").all()
    inputs = _inputs()
    outs = {}
    for backend in ("cpp", "torch"):
        outs[backend] = _run(factorised_attention, inputs, "sum", drop=0.5, backend=backend)[0]
    plain = _run(factorised_attention, inputs, "sum")[0]
    assert not torch.allclose(outs["cpp"], plain)  # dropout changes the output ...
    assert torch.allclose(outs["cpp"], outs["torch"], rtol=0, atol=1e-12)  # ... the same way
    again = _run(factorised_attention, inputs, "sum", drop=0.5, backend="cpp")[0]
    assert torch.equal(again, outs["cpp"])  # reproducibly from torch's seed


def _rows_of(width: int, rows: int, shift: list[int], reverse: bool = False) -> torch.Tensor:
    """Neighbour tables ``(width * rows, J)`` of queries laid row by row on a map of side
    ``width + 4``: neighbour j of query (y, x) is pixel (y + 1, x + shift[j]); ``reverse``
    lists the queries of each row backwards."""
    y, x = torch.arange(rows).repeat_interleave(width), torch.arange(width).repeat(rows)
    if reverse:
        x = width - 1 - x
    return torch.stack([(y + 1) * (width + 4) + x + s for s in shift], dim=1)


def _assert_the_kernel_gives_the_oracles(inputs, form, dtype, case):
    """The C++ kernel's values and gradients against the oracle's, dropout included."""
    ours = _run(factorised_attention, inputs, form, dtype, drop=0.3, backend="cpp")
    oracle = _run(_dense(0.3), inputs, form)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for a, b in zip(ours, oracle, strict=True):
        assert (a.double() - b).abs().max() <= tol * b.abs().max(), case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("form", ["sum", "single"])
def test_kernel_reads_every_neighbour_layout(dtype, form, kernel_at_each_width):
    """A tile of queries (T lanes: 16 or 8 floats, 8 or 4 doubles, by the vector width) whose
    neighbours are one run of consecutive points, two runs (a tile across the end of a row),
    several runs, one point or no run (a row listed backwards) gives the oracle's values and
    gradients, dropout included. At one point, a full tile sums its dk and dv rows over the
    lanes T rows at a time (M d = 18 of them: blocks and a rest)."""
    for width, reverse in [(11, False), (5, False), (11, True), (1, False), (17, False)]:
        nb = _rows_of(width, 6, [0, 1, 3, 2], reverse)
        if width in (1, 17):  # tiles with a lane past the last query, and full ones
            nb[:, 0] = 7  # every query's first neighbour at one point
        q, k, v, group_rho, rho, _, _, valid, n = _inputs(
            n_q=nb.shape[0], n_kv=(width + 4) * 8, j=4, g=2, m=2, d=9 if width == 17 else 5,
            by_v=form == "sum",
        )  # fmt: skip
        inputs = (q, k, v, group_rho, rho, None, nb, valid, n)
        _assert_the_kernel_gives_the_oracles(inputs, form, dtype, (width, reverse))


def _entries_of(width: int, rows: int, shift: list[int], upwards: bool) -> torch.Tensor:
    """Spatial table entries ``(width * rows, J)`` of queries laid row by row, as a global
    layer's: the entry of query (y, x) and neighbour j is that of the offset (shift[j] - x, y'),
    y' = y, or -y when not ``upwards``, in a table of offsets sorted by (y', -x), rows of
    2 width + 8 entries: along an image row the entries rise by one."""
    y, x = torch.arange(rows).repeat_interleave(width), torch.arange(width).repeat(rows)
    row = y if upwards else rows - 1 - y
    return torch.stack([row * (2 * width + 8) + width + 4 - s + x for s in shift], dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("form", ["sum", "single"])
def test_kernel_reads_every_table_entry_layout(dtype, form, kernel_at_each_width):
    """A global layer's tile reads its spatial table at each lane's own entry, off(i, j): one
    rising run, two (a tile across the end of an image row), two whose second run lies below
    the first (read lane by lane), several, one entry for every lane; the values and
    gradients, d rho included, are the oracle's, dropout included."""
    for width, upwards in [(11, True), (11, False), (5, True), (1, True)]:
        rows = 6
        offsets = _entries_of(width, rows, [0, 1, 3, 2], upwards)
        if width == 1:
            offsets[:, 0] = 7  # every query's first neighbour at one entry
        nb = _rows_of(width, rows, [0, 1, 3, 2])
        q, k, v, group_rho, _, _, _, valid, n = _inputs(
            n_q=nb.shape[0], n_kv=(width + 4) * 8, j=4, g=2, m=2, by_v=form == "sum"
        )
        gen = torch.Generator().manual_seed(2)
        rho = torch.randn(n, rows * (2 * width + 8), 2, generator=gen, dtype=torch.float64)
        inputs = (q, k, v, group_rho, rho, offsets, nb, valid, n)
        _assert_the_kernel_gives_the_oracles(inputs, form, dtype, (width, upwards))


@pytest.mark.parametrize("form", ["sum", "single"])
def test_kernel_threads_give_the_same_values_and_gradients(form, kernel_at_each_width):
    """The kernel splits tiles of queries among torch's threads, in both passes; a batch-head
    whose tiles two threads share (2 batch-heads of 5 tiles of 8 doubles over 3 threads) gets
    its dk and dv summed after them. One thread or three, the same numbers (up to the order of
    the per-thread sums)."""
    for inputs in [_inputs(z=5, n_q=9, local=False), _inputs(z=2, n_q=40, n_kv=12)]:
        with threads(1):
            serial = _run(factorised_attention, inputs, form, drop=0.2, backend="cpp")
        with threads(3):
            parallel = _run(factorised_attention, inputs, form, drop=0.2, backend="cpp")
            repeat = _run(factorised_attention, inputs, form, drop=0.2, backend="cpp")
        for a, b, c in zip(serial, parallel, repeat, strict=True):
            assert torch.allclose(a, b, rtol=0, atol=1e-13 * b.abs().max())
            assert torch.equal(b, c)  # deterministic for a thread count


@pytest.mark.parametrize("form", ["sum", "single"])
def test_kernel_keeps_keys_only_where_the_tile_before_read_the_same(form, kernel_at_each_width):
    """A tile keeps the keys and values it gathered for a neighbour when the tile before, of the
    same batch-head, read the same points there (a global layer: every query sees every
    point). Here neighbours 0-2 are the same points for every query, neighbour 3 moves with
    the query, over 3 batch-heads of 37 queries (5 to 10 tiles by the vector width): one thread
    (a batch-head change between two tiles) or three (ranges starting mid-head), the oracle's
    values and gradients."""
    q, k, v, group_rho, rho, offsets, _, valid, n = _inputs(
        z=3, n_q=37, n_kv=40, j=4, local=False, by_v=form == "sum"
    )
    nb = torch.tensor([5, 11, 2, 0]).repeat(37, 1)
    nb[:, 3] = torch.arange(37)
    inputs = (q, k, v, group_rho, rho, offsets, nb, valid, n)
    for count in (1, 3):
        with threads(count):
            _assert_the_kernel_gives_the_oracles(inputs, form, torch.float64, count)


@pytest.mark.parametrize("form", ["sum", "single"])
def test_kernel_gradients_do_not_depend_on_reused_memory(form, kernel_at_each_width):
    """The kernel's dk and dv start as uninitialised memory, zeroed batch-head by batch-head
    by the thread that adds into it (or assigned from the threads' slabs where a batch-head is
    shared). With the allocator handing back blocks just filled with NaN, one thread or three,
    every gradient is still the oracle's: no row is left unwritten."""
    inputs = _inputs(z=5, n_q=9, n_kv=40, by_v=form == "sum")
    oracle = _run(_dense(0.0), inputs, form)
    for count in (1, 3):
        with threads(count):
            for _ in range(3):
                poison = [torch.full((5, 40, 3, 5), math.nan, dtype=torch.float64)
                          for _ in range(8)]  # fmt: skip
                del poison
                ours = _run(factorised_attention, inputs, form, backend="cpp")
                for a, b in zip(ours, oracle, strict=True):
                    assert (a - b).abs().max() <= 1e-10 * b.abs().max(), count


@pytest.mark.parametrize(("form", "shape"), CASES[:5])
def test_backward_takes_a_non_contiguous_output_gradient(form, shape, backend):
    """The layer's W_out hands back a permuted gradient; the result must not depend on it."""
    q, k, v, g_rho, rho, offsets, nb, valid, n = _inputs(**shape)
    q.requires_grad_()
    out = factorised_attention(q, k, v, g_rho, rho, offsets, nb, valid, form=form, n=n,
                               backend=backend)  # fmt: skip
    z, n_q, n, d = out.shape
    grad = torch.randn(z, d, n, n_q, dtype=out.dtype).permute(0, 3, 2, 1)  # as from W_out
    (a,) = torch.autograd.grad(out, q, grad, retain_graph=True)
    (b,) = torch.autograd.grad(out, q, grad.contiguous())
    assert not grad.is_contiguous() and torch.equal(a, b)


INDEX_CASES = [
    ("sum", dict(by_v=True)),
    ("sum", dict(by_v=True, local=False)),
    ("single", dict(by_v=True)),
    ("sum", dict()),  # an index without v ((G, M), as "relative")
    ("single", dict()),
    ("sum", dict(g=8, m=8, d=7, e=4, by_v=True)),
]


@pytest.mark.parametrize(("form", "shape"), INDEX_CASES)
@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_a_table_and_its_index_match_the_gathered_encoding(form, shape, drop, backend):
    """``group_rho`` as an embedding table ``(R, c)`` with ``group_index`` (rows shared by
    many (v, g, m), as every group index shares them) = the oracle on ``table[index]``: values,
    and the table's gradient summed over the entries that read each row."""
    q, k, v, g_rho, rho, offsets, nb, valid, n = _inputs(**shape)
    rows = 5
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(rows, g_rho.shape[-1], generator=gen, dtype=torch.float64)
    index = torch.randint(0, rows - 1, g_rho.shape[:-1], generator=gen)  # row 4 never read
    inputs = (q, k, v, table, rho, offsets, nb, valid, n)
    ours = _run(factorised_attention, inputs, form, drop=drop, chunk=2, backend=backend,
                group_index=index)  # fmt: skip

    def oracle(q, k, v, table, *rest, **kwargs):
        return _dense(drop)(q, k, v, table[index], *rest, **kwargs)

    theirs = _run(oracle, inputs, form)
    for a, b in zip(ours, theirs, strict=True):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max()
    assert torch.equal(ours[4][4], torch.zeros_like(ours[4][4]))  # the unread row
    assert ours[4][:4].abs().min() > 0  # every read row has a gradient


def test_torch_backend_recomputes_chunks_or_keeps_them():
    """With ``recompute`` the torch backend's chunks are checkpointed; either way the same
    gradients."""
    inputs = _inputs(n_q=9)
    a = _run(factorised_attention, inputs, "sum", chunk=2, backend="torch", recompute=True)
    b = _run(factorised_attention, inputs, "sum", chunk=2, backend="torch", recompute=False)
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, rtol=0, atol=1e-13)


def test_bad_arguments():
    q, k, v, g_rho, rho, offsets, nb, valid, n = _inputs()
    args = (q, k, v, g_rho, rho, offsets, nb, valid)
    with pytest.raises(ValueError, match="form='x'"):
        factorised_attention(*args, form="x", n=n)
    with pytest.raises(ValueError, match="dropout 1.0"):
        factorised_attention(*args, form="sum", n=n, drop=1.0)
    with pytest.raises(ValueError, match="backend 'gpu'"):
        factorised_attention(*args, form="sum", n=n, backend="gpu")


def test_auto_backend_is_the_kernel_for_cpu_floats_only(kernel):
    assert core.backend_for("cpu", torch.float32) == "cpp"
    assert core.backend_for("cpu", torch.float64) == "cpp"
    assert core.backend_for("cpu", torch.float16) == "torch"
    assert core.backend_for("meta", torch.float32) == "torch"
    assert core.backend_for("cpu", torch.float32, "torch") == "torch"


def test_autocast_check_knows_devices_without_autocast():
    assert core._autocast_on("meta") is False  # torch raises for it; the core must not
    assert core._autocast_on("cpu") is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert core._autocast_on("cpu") is True
