"""The ``cpp`` backend of the attention core: the fused CPU kernel (``cpp_kernel.cpp``), built
on first use.

The extension is compiled by torch's extension builder (a C++ compiler and ninja; about 30 s,
once per source, checkout, CPU, torch and Python version) into :func:`build_directory`, under
torch's extension cache (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``);
later processes load the cached build. It is compiled for the host CPU (``-march=native``),
its tiles 64 bytes wide with AVX-512 (one vector register), else 32 (one AVX2 register).
``SYMATTN_CPP=0`` in the environment turns it off. When it cannot be built, a warning names
the reason and the core runs its plain PyTorch backend (the same values, more slowly).

Builds are serialised by an advisory lock that the system releases when its holder dies, so
a process killed while compiling does not leave the next one waiting forever (older torch
versions guard their builds with a lock file that outlives a killed holder; while holding
ours, any such file is stale and removed).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

from symattn_cli.nn.gsa.common import DROP_STEPS

SOURCE = Path(__file__).with_name("cpp_kernel.cpp")
NAME = "symattn_gsa_kernel"
ENV = "SYMATTN_CPP"
# at::parallel_for is inline: compiled without OpenMP it runs its whole range on the calling
# thread. With -fopenmp it forks on torch's own OpenMP runtime (libgomp.so.1, which torch has
# loaded before the extension). Linux only: other platforms' compilers differ in the flag.
_LINUX_OPENMP = sys.platform.startswith("linux") and torch.backends.openmp.is_available()
_OPENMP = ["-fopenmp"] if _LINUX_OPENMP else []

_LOCK = threading.Lock()
_STATE: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    """False when ``SYMATTN_CPP`` is set to 0 (or off / false / no)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def build_directory(source: Path | None = None) -> Path:
    """Where the extension is built: one folder per torch and Python version (a build is
    only valid for the torch it was compiled against), per CPU (it is compiled for the host's
    instruction set) and per location of the source file (torch's builder rebuilds when the
    source's path changes, so two checkouts sharing one folder would rebuild it in turn)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    source = source or SOURCE  # the shipped kernel unless another version is named
    where = hashlib.sha1(f"{source.resolve()}|{_cpu_flags()}".encode()).hexdigest()[:8]
    return Path(root) / f"symattn-{python}-torch{torch.__version__}-{where}" / NAME


def _cpu_flags() -> str:
    """The host CPU's feature flags (Linux), or its machine name elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.machine()


def load() -> ModuleType | None:
    """The compiled extension, building it on the first call of the process if needed;
    None when it is turned off or cannot be built (the caller uses its Python loops)."""
    if not enabled():
        return None
    with _LOCK:
        if "module" not in _STATE:
            _STATE["module"] = _build()
        return _STATE["module"]


def load_source(source: Path, vector_bytes: int | None = None) -> ModuleType:
    """Another version of the kernel (a ``cpp_kernel.cpp`` of another revision, for side-by-side
    timings), built under a name of its own; the shipped one when ``source`` has its bytes.
    ``vector_bytes`` (32 or 64): its tiles' width instead of the host's register width (tests
    check both widths on one host). Raises ``RuntimeError`` when it cannot be built."""
    text = Path(source).read_bytes()
    shipped = load()
    if shipped is not None and text == SOURCE.read_bytes():
        if vector_bytes in (None, shipped.vector_bytes):
            return shipped
    digest = hashlib.sha1(text).hexdigest()[:8] + (f"_v{vector_bytes}" if vector_bytes else "")
    # a fixed place per version, so that a second run reuses the build
    stable = build_directory().parent / f"baseline-{digest}" / SOURCE.name
    stable.parent.mkdir(parents=True, exist_ok=True)
    if not stable.exists() or stable.read_bytes() != text:
        stable.write_bytes(text)
    defines = [f"-DSYMATTN_VECTOR_BYTES={vector_bytes}"] if vector_bytes else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        module = _build(stable, f"{NAME}_{digest}", defines)
    if module is None:
        raise RuntimeError(f"the kernel source {source} did not build")
    return module


@contextlib.contextmanager
def using(module: ModuleType):
    """Run the attention on ``module`` (from :func:`load_source`) inside the block."""
    with _LOCK:
        before = _STATE.get("module")
        _STATE["module"] = module
    try:
        yield
    finally:
        with _LOCK:
            _STATE["module"] = before


@contextlib.contextmanager
def _quiet_builder():
    """torch's extension builder logs a warning about CUDA on machines without it."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _build_lock(folder: Path):
    """Exclusive among processes building into ``folder``; released by the system if the
    holder dies. Removes torch's own lock file, which only a dead builder can have left."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "symattn.lock", "w") as handle:
        if os.name == "posix":  # no fcntl elsewhere: torch's own locking only
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
            (folder / "lock").unlink(missing_ok=True)
        yield


def _build(
    source: Path | None = None, name: str = NAME, flags: list[str] | None = None
) -> ModuleType | None:
    # Loading a cached build takes well under a second; if this takes longer, it compiles.
    notice = threading.Timer(
        2.0,
        lambda: print(
            "symattn: compiling the C++ attention kernel (once per version, about 30 s) ...",
            file=sys.stderr,
            flush=True,
        ),
    )
    notice.daemon = True
    try:
        source = source or SOURCE
        folder = build_directory(source)
        with _quiet_builder(), _build_lock(folder):
            from torch.utils import cpp_extension

            notice.start()
            return cpp_extension.load(
                name=name,
                sources=[str(source)],
                extra_cflags=["-O3", "-march=native", *_OPENMP, *(flags or [])],
                extra_ldflags=_OPENMP,
                build_directory=str(folder),
                verbose=False,
            )
    except Exception as error:  # a missing compiler or ninja, a failed build
        reason = " ".join(str(error).split())[:300]
        warnings.warn(
            f"symattn: the C++ attention kernel could not be built ({type(error).__name__}: "
            f"{reason}); the attention runs its plain PyTorch backend, which gives the same "
            "values more slowly. Install a C++ compiler and `pip install ninja` to build it, "
            f"or set {ENV}=0 to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    finally:
        notice.cancel()


# The kernel as registered torch operators (``torch.ops.symattn.gsa_cpp_forward`` and
# ``gsa_cpp_backward``), on the kernel's layouts, channels, then the group axis, then points:
# q (Z, d, G, L), k and v (Z, d, M, Lkv), the group embedding emb (R, c) and its index (1 or
# V, G, M), out (Z, d, V, L); see :func:`cpp_attention`. Registered ops with shape functions
# and a registered backward are opaque to torch.compile, which traces a net around them in
# one graph. ``seed`` is a 0-d int64 tensor, so that drawing it stays in the graph.


@torch.library.custom_op("symattn::gsa_cpp_forward", mutates_args=(), device_types="cpu")
def kernel_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, emb: torch.Tensor | None,
    index: torch.Tensor | None, rho: torch.Tensor | None, offsets: torch.Tensor | None,
    neighbour: torch.Tensor, valid: torch.Tensor | None, single: bool, n: int, threshold: int,
    seed: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    with torch.profiler.record_function("gsa.kernel.forward"):  # named in profiles
        return load().forward(q, k, v, emb, index, rho, offsets, neighbour, valid, single, n,
                              threshold, int(seed))  # fmt: skip


@kernel_forward.register_fake
def _(q, k, v, emb, index, rho, offsets, neighbour, valid, single, n, threshold, seed):
    return q.new_empty((q.shape[0], q.shape[1], n, q.shape[3]))


@torch.library.custom_op("symattn::gsa_cpp_backward", mutates_args=(), device_types="cpu")
def kernel_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    emb: torch.Tensor | None, index: torch.Tensor | None, rho: torch.Tensor | None,
    offsets: torch.Tensor | None, neighbour: torch.Tensor, valid: torch.Tensor | None,
    single: bool, n: int, threshold: int, seed: torch.Tensor,
) -> list[torch.Tensor]:  # fmt: skip
    """``[dq, dk, dv, demb, drho]``; an empty tensor for an absent emb or rho."""
    with torch.profiler.record_function("gsa.kernel.backward"):
        grads = load().backward(grad_out.contiguous(), q, k, v, emb, index, rho, offsets,
                                neighbour, valid, single, n, threshold, int(seed))  # fmt: skip
    return [g if g is not None else q.new_empty(0) for g in grads]


@kernel_backward.register_fake
def _(grad_out, q, k, v, emb, index, rho, offsets, neighbour, valid, single, n, threshold,
      seed):  # fmt: skip
    absent = q.new_empty(0)
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            absent if emb is None else torch.empty_like(emb),
            absent if rho is None else torch.empty_like(rho)]  # fmt: skip


def _save(ctx, inputs, output) -> None:
    *tensors, single, n, threshold, seed = inputs
    ctx.save_for_backward(*tensors, seed)
    ctx.args = (single, n, threshold)
    ctx.present = (inputs[3] is not None, inputs[5] is not None)  # emb, rho


def _backward(ctx, grad_out):
    q, k, v, emb, index, rho, offsets, neighbour, valid, seed = ctx.saved_tensors
    dq, dk, dv, demb, drho = kernel_backward(grad_out, q, k, v, emb, index, rho, offsets,
                                             neighbour, valid, *ctx.args, seed)  # fmt: skip
    has_emb, has_rho = ctx.present
    return (dq, dk, dv, demb if has_emb else None, None, drho if has_rho else None,
            *(None,) * 7)  # fmt: skip


torch.library.register_autograd("symattn::gsa_cpp_forward", _backward, setup_context=_save)


def _rescales() -> bool:
    """Whether the loaded kernel applies the dropout's 1 / (1 - drop) itself (a kernel of an
    older revision, loaded by :func:`using`, may not)."""
    return bool(getattr(load(), "rescales_dropout", False))


def available() -> bool:
    """Whether the kernel is built (or can be) in this process; a constant to torch.compile."""
    return load() is not None


# What torch.compiler.assume_constant_result sets: that decorator imports torch._dynamo, a
# second of every run's start, while torch.compile reads only this mark.
available._dynamo_marked_constant = True  # type: ignore[attr-defined]


def cpp_attention(q, k, v, emb, index, rho, offsets, neighbour, valid, single, n, threshold,
                  seed):  # fmt: skip
    """The factorised attention (:mod:`symattn_cli.nn.gsa.core`) by the fused CPU kernel,
    the 1 / (1 - drop) rescaling of attention dropout included: ``(Z, L, V, d)`` (a view of
    a ``(Z, d, V, L)`` tensor, which the layer's W_out reads without a copy). ``emb`` ``(R,
    c)``: the group embedding, dotted with q's last c channels, and ``index`` ``(G, M)`` or
    ``(V, G, M)`` (sum form only) the row each (g, m) or (v, g, m) reads: gl[v, m, g] = q_ig .
    emb[index[v, g, m]], gathered inside the kernel; both None without a group term. Dropout
    keeps an entry whose 15-bit hash is at least ``threshold``. The kernel takes q, k and v as
    ``(Z, d, G, L)``: the point axis last, so that a tile of consecutive queries, and their
    neighbours at one offset, are runs of consecutive numbers, and channels first, the layout
    of the 1x1 maps that make them (the layer's views are permuted back without a copy)."""

    def points_last(t):  # (Z, P, G, d) -> (Z, d, G, P)
        return None if t is None else t.permute(0, 3, 2, 1).contiguous()

    def flat(t):
        return None if t is None else t.contiguous()

    if emb is not None:
        if index.dim() == 3 and single:  # g = v: the diagonal, (G, M)
            index = torch.diagonal(index, dim1=0, dim2=1).T
        index = (index if index.dim() == 3 else index.unsqueeze(0)).to(torch.long).contiguous()
    if not isinstance(seed, torch.Tensor):
        seed = torch.tensor(seed, dtype=torch.int64)
    out = kernel_forward(
        points_last(q), points_last(k), points_last(v), flat(emb), index if emb is not None
        else None, flat(rho), flat(offsets), flat(neighbour), flat(valid), single, n,
        threshold, seed,
    )  # fmt: skip
    if threshold and not torch.compiler.is_compiling() and not _rescales():  # an older build
        out = out * (1.0 / (1.0 - threshold / DROP_STEPS))
    return out.permute(0, 3, 2, 1)  # (Z, L, V, d)
