"""The C++ chunk loops of the attention core: the same numbers as the Python loops, and a
loader that falls back to those with a clear warning."""

from __future__ import annotations

import pytest
import torch

import symattn_cli.nn.gsa_core as core
from symattn_cli.nn import gsa_native
from symattn_cli.nn.gsa_core import factorised_attention

from .test_gsa_core import CASES, _inputs


def _step(inputs, form, drop, threads, dtype, native, recompute=True):
    """Output and gradients of one forward and backward, with the given chunk loops."""
    q, k, v, g_rho, rho, nb, valid = inputs
    leaves = [
        None if t is None else t.to(dtype).clone().requires_grad_() for t in (q, k, v, g_rho, rho)
    ]
    saved = core.NATIVE
    core.NATIVE = native
    try:
        torch.manual_seed(5)  # the same dropout seeds for both
        out = factorised_attention(
            *leaves,
            nb,
            valid,
            form=form,
            n=rho.shape[0],
            drop=drop,
            chunk=2,
            threads=threads,
            recompute=recompute,
        )
        out.square().sum().backward()
    finally:
        core.NATIVE = saved
    return [out.detach()] + [None if t is None else t.grad for t in leaves]


@pytest.mark.parametrize(("form", "shape"), CASES)
@pytest.mark.parametrize("drop", [0.0, 0.3])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("recompute", [True, False])
def test_native_loops_give_the_python_loops_numbers(form, shape, drop, threads, recompute, native):
    """Same operations in the same order: bit for bit the same outputs and gradients (dropout
    masks included), in one thread or shared among three, with the chunks recomputed in the
    backward or kept from the forward."""
    inputs = _inputs(n_q=9, **shape)
    for dtype in (torch.float64, torch.float32):
        ours = _step(inputs, form, drop, threads, dtype, True, recompute)
        python = _step(inputs, form, drop, threads, dtype, False, recompute)
        assert ours[1] is not None and ours[1].dtype == dtype  # gradients were computed
        for a, b in zip(ours, python, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


def test_native_loops_run_on_cpu_float_only():
    q = torch.zeros(1, 1, 1, 1)
    assert core._native_loops(q.half()) is None  # other dtypes: the Python loops
    assert core._native_loops(q.to(torch.int32)) is None


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(gsa_native.ENV, "0")
    assert not gsa_native.enabled() and gsa_native.load() is None
    monkeypatch.setenv(gsa_native.ENV, "1")
    assert gsa_native.enabled()


def test_a_failed_build_warns_with_the_fix_and_falls_back(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def broken(**kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(gsa_native, "_STATE", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.warns(RuntimeWarning, match="Ninja is required.*pip install ninja"):
        assert gsa_native.load() is None
    # the attention still works, on its Python loops, and the failure is not retried
    q, k, v, g_rho, rho, nb, valid = _inputs()
    out = factorised_attention(q, k, v, g_rho, rho, nb, valid, form="sum", n=3, chunk=2)
    assert torch.isfinite(out).all() and gsa_native._STATE == {"module": None}


def test_chunks_kept_by_the_cpp_loops_are_used_by_the_backward(monkeypatch):
    """recompute=False: the forward hands back the C++ loops' chunks and the backward gets
    them (their values are compared with the Python loops' kept chunks above)."""
    if gsa_native.load() is None:
        pytest.skip("the C++ loops are off")
    q, k, v, g_rho, rho, nb, valid = _inputs(n_q=9)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g_rho, rho)]
    calls = []
    real = core.gsa_native.load()

    class Spy:
        def forward_chunks(self, *args):
            found, handle = real.forward_chunks(*args)
            calls.append(("forward", handle is not None))
            return found, handle

        def backward_chunks(self, *args):
            calls.append(("backward", len(args[-2])))  # the kept handles passed in
            return real.backward_chunks(*args)

    monkeypatch.setattr(core, "_native_loops", lambda q: Spy())
    out = factorised_attention(*leaves, nb, valid, form="sum", n=3, chunk=2, recompute=False)
    out.sum().backward()
    assert calls == [("forward", True), ("backward", 1)]
    assert all(t.grad is not None for t in leaves)


def test_the_build_lock_clears_a_lock_file_left_by_a_killed_build(tmp_path):
    """torch versions that lock builds with a lock file leave it behind when the builder is
    killed, and every later build would wait for it forever; under the lock taken here (which
    the system releases when its holder dies) such a file can only be stale."""
    folder = tmp_path / "build"
    folder.mkdir()
    (folder / "lock").write_text("")
    with gsa_native._build_lock(folder):
        assert not (folder / "lock").exists()
    assert gsa_native.build_directory().name == gsa_native.NAME
    assert torch.__version__ in gsa_native.build_directory().parent.name


def test_each_checkout_builds_in_its_own_folder(monkeypatch, tmp_path):
    """torch's builder rebuilds when the source's path changes: two checkouts of the project
    sharing one build folder would rebuild the extension each time the other one ran."""
    here = gsa_native.build_directory()
    assert gsa_native.build_directory() == here  # the same checkout: the same folder
    monkeypatch.setattr(gsa_native, "SOURCE", tmp_path / "other" / "gsa_core.cpp")
    there = gsa_native.build_directory()
    assert there != here and there.parent.parent == here.parent.parent
