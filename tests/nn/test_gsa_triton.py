"""The Triton kernel of the attention core against the dense oracle (values and gradients,
dropout masks included) and in layers (the C++ kernel's values, exact equivariance): compiled
on a GPU, or without one in Triton's interpreter on CPU tensors (``tests/conftest.py`` turns it
on; small sizes, as it runs each program in Python); that it compiles for a GPU without one;
and, on a GPU only (``gpu`` marker), against the torch backend at full size and under AMP."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import symattn_cli.nn.gsa.core as core
from symattn_cli.groups import get_group
from symattn_cli.nn.gsa import GroupSelfAttention
from symattn_cli.nn.gsa import triton as gsa_triton
from symattn_cli.nn.gsa.core import factorised_attention
from symattn_cli.verify.gsa import build_probe, layer_equivariance
from tests.helpers import REPO, symattn_env, values_and_gradients

from .test_gsa_core import CASES, _dense, _inputs, _run

triton = pytest.importorskip("triton", reason="Triton ships with PyTorch's CUDA wheels only")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def device(triton_device) -> str:
    return triton_device


def _on(device: str, inputs: tuple) -> tuple:
    return tuple(t.to(device) if torch.is_tensor(t) else t for t in inputs)


def _small(shape: dict) -> dict:
    """A case of CASES with one batch-head and three queries (one program each)."""
    return {**shape, "z": 1, "n_q": 3}


def _kernel_only(monkeypatch) -> list:
    """Makes the torch backend unreachable from the dispatcher, and records whether each
    kernel launch had a v-dependent group term (GL_V)."""

    def fallback(*args, **kwargs):
        raise AssertionError("the dispatcher fell back to the torch backend")

    monkeypatch.setattr(core, "torch_attention", fallback)
    program, flags = gsa_triton._program, []

    def recorded(*args):
        module, kernel_args, meta = program(*args)
        flags.append(meta["GL_V"])
        return module, kernel_args, meta

    monkeypatch.setattr(gsa_triton, "_program", recorded)
    return flags


def _oracle_cases():
    """Every case of CASES with all neighbours in one block, then in blocks of two. Blocks of
    two over the 40 neighbours of the two cases that take contractions in passes are 20
    blocks a program in the interpreter, seconds each: marked slow (the quick loop runs those
    cases in one block, and every other case in blocks of two)."""
    for drop, block in [(0.0, None), (0.3, 2)]:
        for i, (form, shape) in enumerate(CASES):
            many = block is not None and shape.get("j", 4) > 16
            yield pytest.param(form, shape, drop, block, id=f"{drop}-{block}-{form}-shape{i}",
                               marks=pytest.mark.slow if many else ())  # fmt: skip


@pytest.mark.parametrize(("form", "shape", "drop", "block"), list(_oracle_cases()))
def test_matches_the_dense_oracle(form, shape, drop, block, device, monkeypatch):
    """Values and gradients to float64 round-off, with the same dropout masks; all neighbours
    in one block, or ``block`` a block (the statistics carried from block to block; 9
    neighbours leave the last block partly filled). The kernel runs every case itself, a
    v-dependent group term (``by_v``) included."""
    flags = _kernel_only(monkeypatch)
    if block:
        launch = gsa_triton._launch

        def small_blocks(*args):
            sizes, blocks = launch(*args)
            return sizes, {**blocks, "BJ": block}

        monkeypatch.setattr(gsa_triton, "_launch", small_blocks)
    inputs = _on(device, _inputs(**_small(shape)))
    ours = _run(factorised_attention, inputs, form, drop=drop, backend="triton")
    oracle = _run(_dense(drop), inputs, form)
    assert len(ours) == len(oracle)
    for a, b in zip(ours, oracle, strict=True):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max()
    # forward and backward; in the single form the dispatcher hands over the diagonal
    assert flags == [shape.get("by_v", False) and form == "sum"] * 2


@pytest.mark.parametrize("backend", ["triton", "triton_tiles"])
@pytest.mark.parametrize(("form", "shape"), [CASES[0], CASES[2], CASES[4]])
def test_spatial_gradient_in_copies(backend, form, shape, device, monkeypatch):
    """Programs add drho into copies of it (program p into copy p mod 3 here; one per SM on
    a GPU) that are summed after the launch: the oracle's drho, and the other gradients."""
    from symattn_cli.nn.gsa import triton_tiles

    module = gsa_triton if backend == "triton" else triton_tiles
    monkeypatch.setattr(module, "gradient_copies", lambda q, rho: 3)
    inputs = _on(device, _inputs(z=2, n_q=5, **{k: v for k, v in shape.items()}))
    ours = _run(factorised_attention, inputs, form, drop=0.3, backend=backend)
    oracle = _run(_dense(0.3), inputs, form)
    for a, b in zip(ours, oracle, strict=True):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max()


@pytest.fixture
def deterministic_mode():
    """``set(warn_only)`` turns torch's deterministic mode on for the test (as the trainer
    does); the mode before is restored after it."""
    from symattn_cli.train.trainer import deterministic_algorithms

    before = torch.are_deterministic_algorithms_enabled()
    warned = torch.is_deterministic_algorithms_warn_only_enabled()
    yield lambda warn_only: deterministic_algorithms(True, warn_only=warn_only)
    deterministic_algorithms(before, warn_only=warned)


def test_atomic_backwards_alert_under_deterministic_mode(deterministic_mode):
    """On a GPU the Triton backwards sum by atomic adds: under torch's deterministic mode they
    raise (or warn with warn_only=True) as torch's own such operations do, naming the backend
    and the reproducible one; on the CPU (the interpreter runs programs in order), or with the
    mode off, nothing."""
    from symattn_cli.nn.gsa.common import alert_not_deterministic

    what, gpu_device = "attention_backend=triton's backward", torch.device("cuda")
    alert_not_deterministic(what, gpu_device)  # the mode off: nothing
    deterministic_mode(warn_only=False)
    with pytest.raises(RuntimeError, match=r"triton's backward .* model\.attention_backend=torch"):
        alert_not_deterministic(what, gpu_device)
    alert_not_deterministic(what, torch.device("cpu"))
    deterministic_mode(warn_only=True)
    with pytest.warns(UserWarning, match="atomic adds on the GPU"):
        alert_not_deterministic(what, gpu_device)


def test_auto_takes_the_torch_core_on_cuda_under_strict_determinism(deterministic_mode):
    """Under torch.use_deterministic_algorithms(True) ``auto`` runs the torch core on a GPU
    (whose gathers' gradients torch sums deterministically); warn_only (the trainer's
    setting) keeps the Triton kernels, which warn."""
    deterministic_mode(warn_only=False)
    assert core.backend_for("cuda") == "torch"
    assert core.backend_for("cuda", grouped=False) == "torch"
    assert core.backend_for("cuda", backend="triton_tiles") == "triton_tiles"  # by name
    deterministic_mode(warn_only=True)
    assert core.backend_for("cuda") == "triton_tiles"


@pytest.mark.parametrize("backend", ["triton", "triton_tiles"])
def test_each_backward_alerts_on_its_inputs_device(backend, device, monkeypatch):
    """Each Triton backward asks for the alert once, for the device its tensors are on."""
    from symattn_cli.nn.gsa import triton_tiles

    module = gsa_triton if backend == "triton" else triton_tiles
    calls = []
    monkeypatch.setattr(module, "alert_not_deterministic", lambda *a: calls.append(a))
    form, shape = CASES[0]
    _run(factorised_attention, _on(device, _inputs(**_small(shape))), form, backend=backend)
    assert calls == [(f"attention_backend={backend}'s backward", torch.device(device))]


# blocks of one: nine a program, seconds in the interpreter; blocks of four (the last partly
# filled) carry the statistics from block to block in the quick loop
@pytest.mark.parametrize("block", [pytest.param(1, marks=pytest.mark.slow), 4, None])
def test_v_dependent_group_term_over_blocks(block, device, monkeypatch):
    """gl ``(Z, L, V, M, G)`` in the kernel: 9 neighbours (global offsets, one invalid for
    some queries) in blocks of 1, 4 (the last partly filled) or all in one, dropout on: its
    logsumexp per v, the output rows per v and dgl per v summed over blocks."""
    flags = _kernel_only(monkeypatch)
    launch = gsa_triton._launch

    def blocks_of(*args):
        sizes, blocks = launch(*args)
        assert blocks["BT"] == 4 and sizes[9] == 3  # T = V rows of the outer logits
        return sizes, {**blocks, "BJ": block or blocks["BJ"]}

    monkeypatch.setattr(gsa_triton, "_launch", blocks_of)
    inputs = _on(device, _inputs(z=2, n_q=2, j=9, local=False, by_v=True))
    ours = _run(factorised_attention, inputs, "sum", drop=0.3, backend="triton")
    oracle = _run(_dense(0.3), inputs, "sum")
    for a, b in zip(ours, oracle, strict=True):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max()
    assert flags == [True, True]


def test_v_dependent_group_term_needs_the_sum_form(device):
    q, k, v, g_rho, rho, offsets, nb, valid, n = _on(device, _inputs(z=1, n_q=3, by_v=True))
    gl = core.group_logits(q, g_rho)  # (Z, L, V, M, G)
    args = (q, k, v, gl, rho, offsets, nb, valid)
    with pytest.raises(ValueError, match="sum form"):
        gsa_triton.triton_attention(*args, True, n, 0, 0)
    with pytest.raises(ValueError, match="V = 4 rows"):
        gsa_triton.triton_attention(*args, False, 4, 0, 0)


@pytest.mark.parametrize(("form", "shape"), CASES[:5] + CASES[10:13])
def test_float32_matches_the_float64_oracle(form, shape, device):
    inputs = _on(device, _inputs(**_small(shape)))
    ours = _run(factorised_attention, inputs, form, torch.float32, drop=0.2, backend="triton")
    oracle = _run(_dense(0.2), inputs, form)
    for a, b in zip(ours, oracle, strict=True):
        assert a.dtype == torch.float32
        assert (a.double() - b).abs().max() <= 2e-5 * b.abs().max()


def test_half_precision_is_computed_in_float32(device):
    """bfloat16 inputs (outside autocast): float32 inside, bfloat16 out, gradients included."""
    inputs = _on(device, _inputs(z=1, n_q=3))
    ours = _run(factorised_attention, inputs, "sum", torch.bfloat16, backend="triton")
    rounded = [t.to(torch.bfloat16).double() if torch.is_tensor(t) and t.is_floating_point()
               else t for t in inputs]  # fmt: skip
    oracle = _run(_dense(0.0), rounded, "sum")
    for a, b in zip(ours, oracle, strict=True):
        assert a.dtype == torch.bfloat16
        assert (a.double() - b).abs().max() <= 2e-2 * b.abs().max()


def test_backward_takes_a_non_contiguous_output_gradient(device):
    q, k, v, g_rho, rho, offsets, nb, valid, n = _on(device, _inputs(z=1, n_q=3))
    q.requires_grad_()
    out = factorised_attention(q, k, v, g_rho, rho, offsets, nb, valid, form="sum", n=n,
                               backend="triton")  # fmt: skip
    z, n_q, n, d = out.shape
    grad = torch.randn(z, d, n, n_q, dtype=out.dtype, device=device).permute(0, 3, 2, 1)
    (a,) = torch.autograd.grad(out, q, grad, retain_graph=True)
    (b,) = torch.autograd.grad(out, q, grad.contiguous())
    assert not grad.is_contiguous() and torch.equal(a, b)


# In the interpreter the sum form by the one-query-a-program kernel takes half a minute (eight
# programs a query); the quick loop runs each kernel in a layer once and both forms in the
# kernels' own tests.
@pytest.mark.parametrize(
    ("kind", "backend"),
    [pytest.param("lifting", "triton", marks=pytest.mark.slow),
     pytest.param("group_sum", "triton", marks=pytest.mark.slow),
     ("group_single", "triton"), pytest.param("network", "triton", marks=pytest.mark.slow),
     ("group_sum", "triton_tiles"),
     pytest.param("group_single", "triton_tiles", marks=pytest.mark.slow)],
)  # fmt: skip
def test_layers_agree_with_the_cpu_kernel_and_are_exactly_equivariant(
    kind, backend, device, monkeypatch, kernel
):
    """z4m (rotations and mirrors: 8 grid-exact elements) on a 3 x 3 image: each Triton kernel
    gives the C++ kernel's values and gradients in float64, with attention dropout on (the same
    masks), and the layer is exactly equivariant for every element."""
    module, x = build_probe(get_group("z4m"), kind, image_size=3, heads=1, dtype=torch.float64)
    for layer in module.modules():
        if isinstance(layer, GroupSelfAttention):
            layer.attention_dropout.p = 0.2
    module.train()
    cpu_out, *cpu_grads = values_and_gradients(module, x)
    asked = []
    monkeypatch.setattr(
        core,
        "backend_for",
        lambda device, dtype=None, backend_="auto", **_: asked.append(1) or backend,
    )
    out, *grads = (t.cpu() for t in values_and_gradients(module.to(device), x.to(device)))
    assert asked  # the core did take the Triton kernel
    assert torch.allclose(out, cpu_out, rtol=0, atol=1e-12 * cpu_out.abs().max())
    scale = max(g.abs().max() for g in cpu_grads)  # some gradients are zero up to round-off
    for a, b in zip(grads, cpu_grads, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12 * scale)
    records = layer_equivariance("z4m", kind, image_size=3, heads=1, device=device)
    assert len(records) == len(get_group("z4m").grid_exact_elements())
    assert max(r["max_rel"] for r in records) <= 1e-10, records


def test_auto_backend_is_a_triton_kernel_on_cuda(monkeypatch):
    """The tiled kernel for group layers, the one-query-a-program kernel for lifting layers."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        assert core.backend_for("cuda", dtype) == "triton_tiles"
        assert core.backend_for("cuda", dtype, grouped=False) == "triton"
    assert core.backend_for("cuda", backend="torch") == "torch"  # the fallback, by name
    assert core.backend_for("cpu", torch.float32, "triton") == "triton"
    monkeypatch.setattr(gsa_triton, "available", lambda: False)
    assert core.backend_for("cuda") == "torch"
    q, k, v, g_rho, rho, offsets, nb, valid, n = _inputs()
    with pytest.raises(ValueError, match="needs Triton"):
        factorised_attention(q, k, v, g_rho, rho, offsets, nb, valid, form="sum", n=n,
                             backend="triton")  # fmt: skip


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(gsa_triton, "interpreted", lambda: False)
    q, k, v, g_rho, rho, offsets, nb, valid, n = _inputs()
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        factorised_attention(q, k, v, g_rho, rho, offsets, nb, valid, form="sum", n=n,
                             backend="triton")  # fmt: skip
    layer = GroupSelfAttention(group=get_group("z4"), in_channels=2, out_channels=6, heads=1,
                               attention_backend="triton")  # fmt: skip
    assert layer.attention_backend == "triton"


# Layer kinds compiled by test_kernels_compile_for_a_gpu: (form, _inputs arguments, dtype,
# dropout rate, with a spatial term).
COMPILED = [
    ("sum", dict(), "float32", 0.1, True),  # group layer, local, dropout
    ("sum", dict(), "float64", 0.1, True),
    ("single", dict(local=False), "float32", 0.0, True),  # global
    ("sum", dict(g=1, m=1), "float32", 0.0, True),  # lifting
    ("sum", dict(g=8, m=8, d=10, e=6, j=25), "float32", 0.1, False),  # r8, no spatial term
    ("sum", dict(by_v=True), "float32", 0.1, True),  # a group term that sees v (GL_V)
    ("sum", dict(by_v=True, local=False), "float64", 0.1, True),
    ("sum", dict(g=8, m=8, d=10, e=6, j=25, by_v=True), "float32", 0.1, True),  # r8, GL_V
    # e > M (the tiled kernel's spatial term through products), rows r in chunks
    ("sum", dict(g=16, m=2, d=8, e=5, j=9, by_v=True), "float32", 0.1, True),
]


def compile_for_gpu(arch: int = 90) -> None:
    """Compiles forward and backward of each of :data:`COMPILED` for an NVIDIA GPU of compute
    capability ``arch`` down to machine code; no GPU needed, but Triton must have been
    imported without its interpreter."""
    from symattn_cli.bench import static
    from symattn_cli.nn.gsa import triton_tiles

    for form, shape, dtype, drop, spatial in COMPILED:
        q, k, v, g_rho, rho, offsets, nb, valid, n = _inputs(**shape)
        dtype = getattr(torch, dtype)
        q, k, v, g_rho = (None if t is None else t.to(dtype) for t in (q, k, v, g_rho))
        rho = rho.to(dtype) if spatial else None
        call = static.Call("layer", q, k, v, g_rho, rho, offsets, nb, valid, form, n, drop)
        for backend in static.KERNELS:
            for launch in static.launches(call, backend):
                compiled = static.compile_launch(launch, arch)
                assert compiled.asm["cubin"], (backend, form, shape, launch.kernel)
                print(f"compiled {backend} {launch.kernel} {form} {shape} {dtype} for sm_{arch}",
                      flush=True)  # fmt: skip
        if drop:  # the tiled kernel's dropout mask, drawn by a kernel of its own
            single = form == "single"
            plan = triton_tiles.plan(q, k, v, triton_tiles.encoding(g_rho, single), rho, offsets,
                                     nb, valid, single, n, 100)  # fmt: skip
            fn, grid, args, meta = triton_tiles.keep_launch(plan, 100, 12345)
            keep = static.Launch("layer", "keep", fn, grid, args, meta, 0.0, 0.0, str(dtype))
            assert static.compile_launch(keep, arch).asm["cubin"]
            print(f"compiled keep mask {form} {shape} for sm_{arch}", flush=True)


@pytest.mark.slow
def test_kernels_compile_for_a_gpu():
    """The compiler accepts what the interpreter runs: every layer kind's forward and backward,
    by both Triton kernels, compiled for an H100 (sm_90) in a process where Triton runs
    compiled."""
    from triton.backends import backends

    from symattn_cli.bench import static

    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")
    env = symattn_env() | {gsa_triton.ENV: "0"}
    code = "from tests.nn.test_gsa_triton import compile_for_gpu; compile_for_gpu()"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    dropout = sum(1 for *_, drop, _ in COMPILED if drop)
    assert done.stdout.count("compiled") == 2 * len(COMPILED) * len(static.KERNELS) + dropout


# ------------------------------------------------------------------ on a GPU


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("form", "shape"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", ["triton", "triton_tiles"])
def test_gpu_kernel_matches_the_torch_backend(form, shape, dtype, backend):
    """Both Triton kernels at the full sizes of every case, with dropout, against the torch
    backend on the same GPU: float64 to round-off, float32 to its accuracy."""
    inputs = _on("cuda", _inputs(**shape))
    ours = _run(factorised_attention, inputs, form, dtype, drop=0.3, backend=backend)
    plain = _run(factorised_attention, inputs, form, dtype, drop=0.3, backend="torch")
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    for a, b in zip(ours, plain, strict=True):
        assert a.is_cuda and (a - b).abs().max() <= tol * b.abs().max()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["lifting", "group_sum", "group_single", "network"])
def test_gpu_layers_are_exactly_equivariant(kind):
    assert core.backend_for("cuda", torch.float64, grouped=False) == "triton"
    assert core.backend_for("cuda", torch.float64) == "triton_tiles"
    records = layer_equivariance("z4m", kind, image_size=6, device="cuda")
    assert max(r["max_rel"] for r in records) <= 1e-10, records


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "triton_tiles"])
def test_gpu_backward_refuses_deterministic_mode(backend, deterministic_mode):
    """Under torch's deterministic mode a Triton backward on the GPU raises; ``auto`` takes
    the torch backend there, whose gathers' gradients torch sums deterministically, and
    gives the same gradients twice."""
    form, shape = CASES[0]
    inputs = _on("cuda", _inputs(**_small(shape)))
    deterministic_mode(warn_only=False)
    with pytest.raises(RuntimeError, match="deterministic mode"):
        _run(factorised_attention, inputs, form, backend=backend)
    first = _run(factorised_attention, inputs, form, backend="auto")
    for a, b in zip(first, _run(factorised_attention, inputs, form, backend="auto"), strict=True):
        assert torch.equal(a, b)


@gpu
@pytest.mark.gpu
def test_gpu_mixed_precision_follows_float32():
    """``trainer.amp`` on a GPU: float16 autocast around a Triton core that runs in float32."""
    import symattn_cli

    torch.manual_seed(0)
    model = symattn_cli.create_model("gsa_mini", group="r8", channels=8, heads=2).cuda()
    x = torch.randn(4, 1, 28, 28, device="cuda")
    target = torch.randint(0, 10, (4,), device="cuda")

    def gradients(amp: bool):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            loss = torch.nn.functional.cross_entropy(model(x).float(), target)
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    loss32, grad32 = gradients(False)
    loss16, grad16 = gradients(True)
    assert torch.isfinite(grad16).all() and abs(loss16 - loss32) <= 0.05 * loss32
    assert torch.nn.functional.cosine_similarity(grad16.float(), grad32, dim=0) > 0.98
