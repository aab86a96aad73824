"""The loader of the fused CPU kernel: built once per checkout and CPU, off by the environment,
and a failed build warns with the fix and falls back to the torch backend."""

from __future__ import annotations

import pytest
import torch

from symattn_cli.nn.gsa import core as gsa_core
from symattn_cli.nn.gsa import cpp as gsa_cpp
from symattn_cli.nn.gsa.core import factorised_attention
from tests.helpers import threads

from .test_gsa_core import _inputs


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(gsa_cpp.ENV, "0")
    assert not gsa_cpp.enabled() and gsa_cpp.load() is None
    monkeypatch.setenv(gsa_cpp.ENV, "1")
    assert gsa_cpp.enabled()


def test_the_kernel_runs_on_every_intra_op_thread():
    """at::parallel_for is compiled into the extension: built without OpenMP it runs the
    whole range on the calling thread, whatever torch's thread count."""
    module = gsa_cpp.load()
    if module is None:
        pytest.skip("the C++ kernel is not built here")
    for count in (1, 2):
        with threads(count):
            assert module.parallel_threads() == count


def test_a_tile_is_one_vector_register_of_the_host(kernel):
    """64 bytes with AVX-512, else 32: wider than a register, every vector operation is split
    into pieces moved through memory."""
    wide = "avx512f" in gsa_cpp._cpu_flags().split()
    assert gsa_cpp.load().vector_bytes == (64 if wide else 32)


def test_a_failed_build_warns_with_the_fix_and_falls_back(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def broken(**kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(gsa_cpp, "_STATE", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.warns(RuntimeWarning, match="Ninja is required.*pip install ninja"):
        assert gsa_cpp.load() is None
    # the attention still works, on the torch backend, and the failure is not retried
    q, k, v, g_rho, rho, offsets, nb, valid, n = _inputs()
    assert gsa_core.backend_for("cpu") == "torch"
    out = factorised_attention(q, k, v, g_rho, rho, offsets, nb, valid, form="sum", n=n)
    assert torch.isfinite(out).all() and gsa_cpp._STATE == {"module": None}


def test_the_build_lock_clears_a_lock_file_left_by_a_killed_build(tmp_path):
    """torch versions that lock builds with a lock file leave it behind when the builder is
    killed, and every later build would wait for it forever; under the lock taken here (which
    the system releases when its holder dies) such a file can only be stale."""
    folder = tmp_path / "build"
    folder.mkdir()
    (folder / "lock").write_text("")
    with gsa_cpp._build_lock(folder):
        assert not (folder / "lock").exists()
    assert gsa_cpp.build_directory().name == gsa_cpp.NAME
    assert torch.__version__ in gsa_cpp.build_directory().parent.name


def test_each_checkout_and_cpu_builds_in_its_own_folder(monkeypatch, tmp_path):
    """torch's builder rebuilds when the source's path changes: two checkouts of the project
    sharing one build folder would rebuild the extension each time the other one ran."""
    here = gsa_cpp.build_directory()
    assert gsa_cpp.build_directory() == here  # the same checkout: the same folder
    monkeypatch.setattr(gsa_cpp, "SOURCE", tmp_path / "other" / "cpp_kernel.cpp")
    there = gsa_cpp.build_directory()
    assert there != here and there.parent.parent == here.parent.parent
    monkeypatch.setattr(gsa_cpp, "SOURCE", here.parent.parent / "x")
    monkeypatch.setattr(gsa_cpp, "_cpu_flags", lambda: "flags: avx2")
    avx2 = gsa_cpp.build_directory()
    monkeypatch.setattr(gsa_cpp, "_cpu_flags", lambda: "flags: avx512f")
    assert gsa_cpp.build_directory() != avx2  # compiled for the host CPU: one per CPU


def _kernel_inputs(z=2, d=4, g=4, m=4, points=10, r=4):
    """Inputs in the kernel's own layouts: q (Z, d, G, L), k and v (Z, d, M, L), the group
    embedding (R, c) and its index (1, G, M), every point its own single neighbour."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(z, d, n, points, generator=gen) for n in (g, m, m))
    emb = torch.randn(r, 2, generator=gen)
    index = torch.randint(0, r, (1, g, m), generator=gen)
    neighbour = torch.arange(points).unsqueeze(1)
    return q, k, v, emb, index, neighbour


def test_a_group_index_outside_the_embedding_is_refused(kernel):
    module = gsa_cpp.load()
    q, k, v, emb, index, neighbour = _kernel_inputs()
    args = (None, None, neighbour, None, False, 4, 0, 0)
    assert torch.isfinite(module.forward(q, k, v, emb, index, *args)).all()
    for bad in (emb.shape[0], -1):
        wrong = index.clone()
        wrong[0, 1, 2] = bad
        with pytest.raises(RuntimeError, match=r"the group index must be in \[0, R\)"):
            module.forward(q, k, v, emb, wrong, *args)


def test_other_python_threads_run_while_the_kernel_computes(kernel):
    """The kernel's calls release the interpreter lock: a thread of the caller's process (a
    logger, a plotter) is not held up for the length of a forward or backward. Holding it, a
    call would stop the thread for the call's whole length."""
    import threading
    import time

    module = gsa_cpp.load()
    q, k, v, emb, index, _ = _kernel_inputs(z=32, d=16, points=1024)
    neighbour = torch.arange(1024).repeat(1024, 1)[:, :64].contiguous()  # 64 neighbours each
    args = (emb, index, None, None, neighbour, None, False, 4, 0, 0)
    go = torch.ones(32, 16, 4, 1024)
    longest, stop = [0.0], threading.Event()

    def count():  # the longest stretch between two of this thread's steps
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            longest[0], last = max(longest[0], now - last), now

    thread = threading.Thread(target=count)
    thread.start()
    try:
        time.sleep(0.01)
        start = time.perf_counter()
        module.backward(go, q, k, v, *args)
        call = time.perf_counter() - start
    finally:
        stop.set()
        thread.join()
    assert call > 0.05, "the call is too short to tell"
    assert longest[0] < call / 2, (longest[0], call)
