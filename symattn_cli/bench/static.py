"""A static GPU report of the Triton attention kernels: compiled for a named NVIDIA
architecture on any machine (no GPU needed), at the sizes a model's attention layers run at.

For every attention layer of the model (its calls of the attention core recorded in one
training-mode forward on the CPU, which the report does not time) the forward and the backward
kernel are compiled to machine code (SASS), and read back with the CUDA binary tools that ship
with Triton (``cuobjdump``, ``nvdisasm``):

- **resources**: registers per thread, the stack frame (spilled registers live there) and
  the spill instructions in the code (``STL``/``LDL``), shared memory per block;
- **occupancy**: blocks per SM as registers, shared memory, warps and the block limit allow,
  for the architecture's limits (:data:`GPUS`), as warps resident over the warps an SM can hold;
- **programs and waves**: the grid, over the SMs times blocks per SM;
- **instructions**: the SASS counted per warp, each instruction weighted by the trip counts of
  the loops around it (a loop is a backward branch; its trip count is read from the ``for``
  statement of the kernel source that the branch's line information names, evaluated at the
  launch's sizes; a loop the compiler unrolled is split between its unrolled copy and its
  remainder in proportion to their sizes). Both sides of a branch are counted, so this is an
  upper estimate of what runs. The same counts by line of the kernel's source
  (:func:`counts_by_line`, :func:`top_lines`) say where they go;
- **work the warps repeat**: from the compiler's layouts (TTGIR), the share of the
  floating-point operations' lanes that hold what another warp of the program also holds
  (a tensor smaller than its layout's warps cover, or a layout that keeps every warp on
  the same elements), each operation weighted by its tensor's size, not by trip counts;
- **three lower bounds on the time**: instruction issue (warp instructions over SMs x warp
  schedulers x clock, one instruction per scheduler per cycle), arithmetic (the useful
  floating-point operations of the algorithm, :func:`useful_flops`, over the peak of the
  units that run them: FP32 or FP64 FMA pipes, or tensor cores where the code has MMA
  instructions) and memory (the bytes each kernel must move at least, :func:`dram_bytes`,
  over the DRAM bandwidth).

They are estimates from the compiled code, not measurements. With a GPU, :func:`measure`
times each launch there beside its bounds (``device=cuda``), and ``symattn benchmark
preset=gpu device=cuda`` times the whole training step.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import linecache
import math
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from symattn_cli.errors import ConfigError


@dataclass(frozen=True)
class GPU:
    """The peak figures and per-SM limits of one GPU, as its vendor states them."""

    name: str
    sms: int
    schedulers: int  # warp schedulers per SM: warp instructions issued per cycle
    clock_ghz: float  # boost clock
    fp32_tflops: float  # FMA pipes, dense
    fp64_tflops: float
    tf32_tflops: float  # tensor cores, dense
    dram_tbps: float
    regs_per_sm: int = 65536
    max_warps: int = 64  # resident warps per SM
    max_blocks: int = 32
    smem_per_sm: int = 228 * 1024
    reserved_smem: int = 1024  # per block, taken by the system


# compute capability -> the data-centre GPU of that architecture
GPUS: dict[int, GPU] = {
    90: GPU("H100 SXM5", sms=132, schedulers=4, clock_ghz=1.98, fp32_tflops=67.0,
            fp64_tflops=34.0, tf32_tflops=494.7, dram_tbps=3.35),
    80: GPU("A100 SXM4 80GB", sms=108, schedulers=4, clock_ghz=1.41, fp32_tflops=19.5,
            fp64_tflops=9.7, tf32_tflops=156.0, dram_tbps=2.039, smem_per_sm=164 * 1024),
}  # fmt: skip


def gpu_for(arch: int) -> GPU:
    if arch not in GPUS:
        raise ConfigError(f"arch={arch}: no peak figures for it; choose one of {sorted(GPUS)}")
    return GPUS[arch]


# ---------------------------------------------------------------- the model's attention calls


@dataclass
class Call:
    """One call of the attention core: its arguments as the dispatcher received them."""

    layer: str
    q: Any
    k: Any
    v: Any
    group_rho: Any
    rho: Any
    offsets: Any
    neighbour: Any
    valid: Any
    form: str
    n: int
    drop: float


def attention_calls(case) -> list[Call]:
    """The attention core's calls in one training-mode forward of ``case`` (a benchmark
    :class:`~symattn_cli.bench.measure.Case`, resolved) on the CPU, read by the dispatcher's
    recorder (:func:`~symattn_cli.nn.gsa.core.recording`); the core itself is not run (zeros
    stand in for its output)."""
    import torch

    from symattn_cli.bench.measure import build_case
    from symattn_cli.nn.gsa import core

    module, x, _ = build_case(case, "cpu")
    module.train()
    with torch.no_grad(), core.recording(run=False) as recorded:
        module(x)
    calls = []
    for number, call in enumerate(recorded, 1):
        q, k = call.q, call.k
        kind = "lifting" if q.shape[2] == 1 and k.shape[2] == 1 else f"group {call.form}"
        side = math.isqrt(q.shape[1])
        where = f"{side}x{side}" if side * side == q.shape[1] else f"{q.shape[1]} points"
        calls.append(Call(f"{number} {kind} {where}", q, k, call.v, call.encoding, call.rho,
                          call.offsets, call.neighbour, call.valid, call.form, call.n,
                          call.drop))  # fmt: skip
    return calls


@dataclass
class Launch:
    """One kernel launch of a call: what the compiler and the bounds need."""

    layer: str
    kernel: str  # forward | backward
    fn: Any
    grid: tuple[int, ...]
    args: tuple
    meta: dict[str, Any]
    flops: float
    bytes: float
    dtype: str


KERNELS = ("triton", "triton_tiles")  # the attention backends with Triton kernels


def baseline_launchers(revision: str, directory: Path) -> dict[str, ModuleType]:
    """Each Triton backend's launcher (``symattn_cli/nn/gsa/<backend>.py``) at git ``revision``
    of this checkout, with its kernel module (``<backend>_kernel.py``) of that revision in
    place of today's: copies written into ``directory`` and imported from there. The
    launcher's copy imports the kernel module's copy (its ``kernels()`` import line is
    written so) rather than today's."""
    import importlib.util
    import sys

    from symattn_cli.bench.revision import copy_at

    package = Path(__file__).resolve().parents[1] / "nn" / "gsa"
    loaded = {}
    for backend in KERNELS:
        for name in (f"{backend}_kernel", backend):
            try:
                path = copy_at(package / f"{name}.py", revision, directory)
            except ValueError as err:
                raise ConfigError(
                    f"kernel_baseline={revision!r}: no {name}.py at that revision of this "
                    f"checkout ({err}); give a commit such as HEAD~1"
                ) from None
            if name == backend:
                _import_copied_kernels(path, backend, revision)
            spec = importlib.util.spec_from_file_location(f"symattn_baseline_{name}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # Triton reads the kernels' source through it
            spec.loader.exec_module(module)
        loaded[backend] = module
    return loaded


def _import_copied_kernels(launcher: Path, backend: str, revision: str) -> None:
    """Point the copied launcher's import of its kernel module at the copied kernel module
    (``symattn_baseline_<backend>_kernel``, imported first), line for line."""
    pattern = re.compile(rf"^([ \t]*)from symattn_cli\.nn\.gsa import ({backend}_kernel)[ \t]*$",
                         re.MULTILINE)  # fmt: skip
    text, found = pattern.subn(r"\1import symattn_baseline_\2 as \2", launcher.read_text())
    if not found:
        raise ConfigError(f"kernel_baseline={revision!r}: its {backend}.py does not import "
                          f"its kernels as 'from symattn_cli.nn.gsa import {backend}_kernel'; "
                          "give a later commit")  # fmt: skip
    launcher.write_text(text)


def launches(call: Call, backend: str = "triton", sms: int = 1,
             launcher: ModuleType | None = None) -> list[Launch]:  # fmt: skip
    """The forward and backward launches of ``backend``'s Triton kernels for ``call`` on a GPU
    of ``sms`` multiprocessors (the copies of drho the backward adds into depend on it), by
    today's launcher of that backend or by ``launcher`` (:func:`baseline_launchers`)."""
    import torch

    import symattn_cli.nn.gsa.core as core
    from symattn_cli.nn.gsa import triton as gsa_triton
    from symattn_cli.nn.gsa import triton_tiles
    from symattn_cli.nn.gsa.common import DROP_STEPS, gradient_copies

    if launcher is not None:
        gsa_triton = triton_tiles = launcher

    if backend not in KERNELS:
        raise ConfigError(f"attention backend {backend!r} has no Triton kernel; choose from "
                          f"{', '.join(KERNELS)}")  # fmt: skip
    single = call.form == "single"
    q, k, v, rho = (None if t is None else t.contiguous() for t in
                    (call.q, call.k, call.v, call.rho))  # fmt: skip
    threshold = round(call.drop * DROP_STEPS)
    rest = (call.offsets, call.neighbour.contiguous(),
            None if call.valid is None else call.valid.contiguous(), single, call.n, threshold,
            0x123456789)  # fmt: skip
    copies = gradient_copies(q, rho, sms)
    z, n_q, _, d = q.shape
    out = q.new_empty(z, n_q, call.n, d)
    go = torch.zeros_like(out)
    dqkv = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    if backend == "triton":
        enc = core.group_logits(q, call.group_rho, single)  # (Z, L, [V,] M, G)
        lse = gsa_triton.statistics(q, enc, rho, single, call.n)
        grads = (*dqkv, q if enc is None else torch.zeros_like(enc))
        kernels = (
            gsa_triton.forward_launch(out, lse, q, k, v, enc, rho, *rest),
            gsa_triton.backward_launch(grads, go, lse, q, k, v, enc, rho, *rest, copies=copies),
        )
    else:
        enc = triton_tiles.encoding(call.group_rho, single)  # (Vg, G, M, c)
        lse = triton_tiles.statistics(q, enc, rho, single, call.n)
        # a baseline's launcher may be older: one whose plan took the seed (the kernels drew
        # the dropout mask) and whose backward ran a program a tile
        takes = inspect.signature(triton_tiles.plan).parameters
        launch = triton_tiles.plan(q, k, v, enc, rho, *(rest if "seed" in takes else rest[:-1]))
        extra = {}
        if hasattr(triton_tiles, "backward_programs"):
            extra["programs"] = triton_tiles.backward_programs(q, sms)
        kernels = (
            triton_tiles.forward_launch(out, lse, launch),
            triton_tiles.backward_launch(dqkv, go, lse, launch, copies=copies, **extra),
        )
    dtype = str(q.dtype).removeprefix("torch.")
    result = []
    for name, (fn, grid, args, meta) in zip(("forward", "backward"), kernels, strict=True):
        shapes = _sizes(q, k, enc, rho, call.neighbour, call.n, single, fn, args)
        result.append(Launch(call.layer, name, fn, grid, args, meta,
                             useful_flops(shapes, name), dram_bytes(shapes, name, q.element_size()),
                             dtype))  # fmt: skip
    return result


def _sizes(q, k, enc, rho, neighbour, n, single, fn, args) -> dict[str, Any]:
    """The sizes the bounds need; ``enc``: the group logits (``triton``) or the group encoding
    (``triton_tiles``) as the kernel reads it; the index tables the kernel reads, in bytes."""
    z, n_q, g, d = q.shape
    gl_v = enc is not None and (enc.dim() == 5 or enc.dim() == 4 and enc.shape[0] > 1)
    values = dict(zip(fn.arg_names, args, strict=False))
    tables = [values[name] for name in ("nb_ptr", "off_ptr", "valid_ptr", "halo_ptr", "slot_ptr",
                                        "row_ptr") if name in values]  # fmt: skip
    tables = {t.data_ptr(): t.numel() * t.element_size() for t in tables}
    return dict(Z=z, L=n_q, Lkv=k.shape[1], G=g, M=k.shape[2], d=d, J=neighbour.shape[1],
                e=0 if rho is None else rho.shape[2], D=0 if rho is None else rho.shape[1],
                V=n, enc=0 if enc is None else enc.numel(), single=single,
                rows=n if gl_v or not (single or rho is None) else 1, gl_v=gl_v,
                tables=sum(tables.values()))  # fmt: skip


def useful_flops(s: dict[str, Any], kernel: str) -> float:
    """The floating-point operations of the factorised algorithm (2 per multiply-add; the
    products only, not the exponentials and softmax arithmetic), for all queries of one launch.

    Per query point and batch-head, with K rows of the outer softmax: content q.k J M G d;
    spatial K J G e; sum form W = sum_m pi v J M G d and out = sum beta W K J G d (single:
    J G d); with a v-dependent group term the mixed weights P = sum_g beta pi V J M G and
    out = P v V J M d. The backward has two products for each of the forward's."""
    J, M, G, d, e, V = s["J"], s["M"], s["G"], s["d"], s["e"], s["V"]
    rows = 1 if s["single"] else (V if (s["e"] or s["gl_v"]) else 1)
    content = J * M * G * d
    spatial = (J * G if s["single"] else rows * J * G) * e
    if s["gl_v"]:
        values = V * J * M * G + V * J * M * d
    elif s["single"]:
        values = J * M * G * d + J * G * d
    else:
        values = J * M * G * d + rows * J * G * d
    per_query = 2 * (content + spatial + values)
    factor = 1 if kernel == "forward" else 2
    return float(factor * per_query * s["Z"] * s["L"])


def dram_bytes(s: dict[str, Any], kernel: str, size: int) -> float:
    """The bytes a kernel must move at least: each input read once and each output written
    once (forward: q, k, v, the group term as the kernel reads it, rho and the index tables
    in; out and the outer log-sum-exp; backward: the same and the output gradient in; dq, dk,
    dv and the group term's and rho's gradients out)."""
    Z, L, Lkv, G, d, V = s["Z"], s["L"], s["Lkv"], s["G"], s["d"], s["V"]
    q = Z * L * G * d
    kv = 2 * Z * Lkv * s["M"] * d
    rho = V * s["D"] * s["e"]
    out = Z * L * V * d + Z * L * G * s["rows"]  # and the outer log-sum-exp
    inputs = (q + kv + s["enc"] + rho) * size + s["tables"]
    if kernel == "forward":
        return float(inputs + out * size)
    return float(inputs + out * size + (q + kv + s["enc"] + rho) * size)


# ---------------------------------------------------------------- compiling and reading SASS


_TYPES = {"float32": "fp32", "float64": "fp64", "int64": "i64", "int32": "i32", "int16": "i16",
          "int8": "i8", "uint8": "u8",
          "bool": "i1"}  # fmt: skip


def signature(fn, args, meta) -> dict[str, str]:
    """Triton's signature of ``fn`` called with ``args`` and compile-time ``meta``."""
    import torch

    values = dict(zip(fn.arg_names, args, strict=False))
    out = {}
    for name in fn.arg_names:
        if name in meta:
            out[name] = "constexpr"
        elif torch.is_tensor(values[name]):
            out[name] = "*" + _TYPES[str(values[name].dtype).removeprefix("torch.")]
        else:
            out[name] = "i32" if -(2**31) <= values[name] < 2**31 else "i64"
    return out


OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def compile_launch(launch: Launch, arch: int):
    """``launch``'s kernel compiled for compute capability ``arch`` (no GPU needed; Triton
    must have been imported without its interpreter)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    constexprs = {k: v for k, v in launch.meta.items() if k not in OPTIONS}
    options = {k: v for k, v in launch.meta.items() if k in OPTIONS}
    source = ASTSource(launch.fn, signature(launch.fn, launch.args, constexprs),
                       constexprs=constexprs)  # fmt: skip
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def tool(name: str) -> str:
    """A CUDA binary tool: Triton's own copy, else one on the PATH."""
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if bundled.exists():
        return str(bundled)
    found = shutil.which(name)
    if not found:
        raise ConfigError(f"{name} not found (it ships with Triton's NVIDIA backend)")
    return found


@contextlib.contextmanager
def _cubin_file(cubin: bytes) -> Iterator[str]:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        Path(path).write_bytes(cubin)
        yield path


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers per thread, stack frame and static shared memory (bytes) from the cubin."""
    with _cubin_file(cubin) as path:
        text = subprocess.run([tool("cuobjdump"), "-res-usage", path], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {key.lower(): int(value) for key, value in fields.items()}


@dataclass
class Instruction:
    address: int
    opcode: str
    line: tuple[str, int] | None  # source file and line (the innermost of an inlined call)
    target: str | None  # branch target label
    # the source lines of the calls it was inlined through, innermost first
    chain: tuple[tuple[str, int], ...] = ()


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_WHERE = re.compile(r'//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?')


def sass(cubin: bytes) -> tuple[list[Instruction], dict[str, int]]:
    """The machine code with each instruction's source lines, and the labels' addresses."""
    with _cubin_file(cubin) as path:
        text = subprocess.run([tool("nvdisasm"), "-gi", "-c", path], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    return parse_sass(text)


def parse_sass(text: str) -> tuple[list[Instruction], dict[str, int]]:
    """:func:`sass` from ``nvdisasm -gi -c`` output: before each run of instructions a group
    of ``//## File "f", line n [inlined at "f2", line n2]`` comments, innermost call first."""
    code: list[Instruction] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    chain: list[tuple[str, int]] = []
    grouping = False
    for raw in text.splitlines():
        where = _WHERE.search(raw)
        if where:
            if not grouping:
                chain, grouping = [], True
            for file, number in (where.group(1, 2), where.group(3, 4)):
                if file is not None and (file, int(number)) not in chain:
                    chain.append((file, int(number)))
            continue
        label = re.match(r"^(\.L_x_\d+):", raw.strip())
        if label:
            pending.append(label.group(1))
            continue
        found = _INSTRUCTION.search(raw)
        if not found:
            continue
        grouping = False
        address = int(found.group(1), 16)
        for name in pending:
            labels[name] = address
        pending = []
        target = re.search(r"`\((\.L_x_\d+)\)", found.group(3))
        code.append(Instruction(address, found.group(2), chain[0] if chain else None,
                                target and target.group(1), tuple(chain)))  # fmt: skip
    return code, labels


# Opcodes of a loop body's work (floating point, memory): how many copies an unrolled loop
# holds is the ratio of their counts.
_WORK = ("F", "D", "MUFU", "LDG", "STG", "LDS", "STS", "RED", "ATOM", "HMMA", "HGMMA")


@dataclass
class Loop:
    start: int
    end: int
    line: tuple[str, int] | None
    size: int  # work instructions in the body
    parent: Loop | None = None
    trips: float = 1.0
    known: bool = True


def _trip_count(line: tuple[str, int] | None, names: dict[str, Any]) -> int | None:
    """The trip count of the ``for ... in range(...)`` statement at ``line``, its bounds
    evaluated with ``names``; None where the line is no such statement."""
    if line is None:
        return None
    text = linecache.getline(line[0], line[1]).split("#")[0].strip()  # without a comment
    if not text.startswith("for "):
        return None
    try:
        node = ast.parse(text + " pass").body[0]
        call = node.iter
        bounds = [eval(compile(ast.Expression(a), "<bound>", "eval"), {}, names)  # noqa: S307
                  for a in call.args]  # fmt: skip
    except Exception:  # noqa: BLE001 (not a plain range over the kernel's sizes)
        return None
    return len(range(*[int(b) for b in bounds]))


def loops(code: list[Instruction], labels: dict[str, int], names: dict[str, Any],
          source: str | None = None) -> list[Loop]:  # fmt: skip
    """The loops of ``code`` (backward branches), nested, with their trip counts. A branch
    whose line is no ``for`` statement is read at the same line of ``source``, the kernel's
    file: Triton's line information can name the file of a helper inlined last but keep the
    loop's line."""
    found = []
    for ins in code:
        if ins.opcode.startswith("BRA") and ins.target in labels:
            start = labels[ins.target]
            if start < ins.address:  # (a branch to itself ends the code: never run)
                body = [i for i in code if start <= i.address <= ins.address]
                work = sum(i.opcode.startswith(_WORK) for i in body)
                found.append(Loop(start, ins.address, ins.line, max(work, 1)))
    found.sort(key=lambda lp: (lp.start, -lp.end))
    for loop in found:
        around = [o for o in found if o is not loop and o.start <= loop.start
                  and loop.end <= o.end]  # fmt: skip
        loop.parent = min(around, key=lambda o: o.end - o.start) if around else None
    # Copies of one source loop under one parent: an unrolled loop and its remainder.
    by_source: dict[tuple, list[Loop]] = {}
    for loop in found:
        by_source.setdefault((loop.line, id(loop.parent)), []).append(loop)
    for copies in by_source.values():
        n = _trip_count(copies[0].line, names)
        if n is None and source is not None and copies[0].line is not None:
            n = _trip_count((source, copies[0].line[1]), names)
        if n is None:
            for loop in copies:
                loop.known = False
            continue
        smallest = min(loop.size for loop in copies)
        left = n
        for index, loop in enumerate(copies):
            last = index == len(copies) - 1
            unroll = 1 if last else max(1, 2 ** round(math.log2(loop.size / smallest)))
            loop.trips = left if last else left // unroll
            left -= loop.trips * unroll
    return found


def _weight(ins: Instruction, found: list[Loop]) -> float:
    """How often ``ins`` runs: the product of the trip counts of the loops around it."""
    weight = 1.0
    for loop in found:
        if loop.start <= ins.address <= loop.end:
            weight *= loop.trips
    return weight


def weighted_counts(code: list[Instruction], found: list[Loop]) -> dict[str, float]:
    """Instructions per warp, each weighted by the trip counts of the loops around it, in
    total and by kind."""
    kinds = {
        "global": ("LDG", "STG"), "atomic": ("RED", "ATOM"), "barrier": ("BAR",),
        "shared": ("LDS", "STS"), "spill": ("LDL", "STL"), "mma": ("HMMA", "HGMMA", "DMMA", "IMMA"),
        "fma": ("FFMA", "DFMA", "FMUL", "DMUL", "FADD", "DADD"),
    }  # fmt: skip
    counts = dict.fromkeys(["instructions", *kinds], 0.0)
    for ins in code:
        weight = _weight(ins, found)
        counts["instructions"] += weight
        for kind, prefixes in kinds.items():
            if ins.opcode.startswith(prefixes):
                counts[kind] += weight
    return counts


def counts_by_line(code: list[Instruction], found: list[Loop], source: str) -> dict[int, float]:
    """Instructions per warp by line of the kernel's file ``source``, weighted as in
    :func:`weighted_counts`. An instruction counts at the innermost line of ``source`` that
    it was inlined through: a helper's line (summed over its callers), or the line that calls
    a function of Triton's library (``tl.sum``, ``tl.max``). Line 0: none of ``source``."""
    counts: dict[int, float] = {}
    for ins in code:
        line = next((n for file, n in ins.chain if file == source), 0)
        counts[line] = counts.get(line, 0.0) + _weight(ins, found)
    return counts


_ALIAS = re.compile(r"^(#[\w]+) = (#ttg\.\w+<.*>)\s*$", re.MULTILINE)
_FLOAT_OP = re.compile(r"= (?:arith\.\w+f|math\.\w+|arith\.select)\b")


def _inner(text: str, start: int, brackets: str = "<>") -> str:
    """The text between the opening bracket at ``start`` and its match (``brackets``: the
    opening and the closing one)."""
    depth = 0
    for at in range(start, len(text)):
        depth += {brackets[0]: 1, brackets[1]: -1}.get(text[at], 0)
        if depth == 0:
            return text[start + 1 : at]
    raise ValueError(f"unbalanced layout text: {text[start:]!r}")


def _ints(text: str, key: str) -> list[int]:
    found = re.search(key + r" = \[([\d, ]*)\]", text)
    return [int(x) for x in found.group(1).split(",") if x.strip()] if found else []


def warp_bases(layout: str, aliases: dict[str, str]) -> list[list[int]] | None:
    """How the warps of a program step through a tensor in ``layout`` (TTGIR text or one of
    the ``aliases``): one vector per bit of the warp index, the element offset that bit adds
    (all zero: warps differing in that bit hold the same elements). None for layouts that are
    no distributed tensors' (operands of a product, shared memory)."""
    layout = aliases.get(layout.strip(), layout.strip())
    kind = re.match(r"#ttg\.(\w+)<", layout)
    if not kind:
        return None
    body = _inner(layout, kind.end() - 1)
    if kind.group(1) == "slice":  # the parent without axis `dim`
        dim = int(re.search(r"dim = (\d+)", body).group(1))
        parent = warp_bases(body.split("parent = ", 1)[1].rstrip("}"), aliases)
        return None if parent is None else [b[:dim] + b[dim + 1 :] for b in parent]
    if kind.group(1) == "linear":
        warp = _inner(body, body.index("warp = [") + len("warp = "), "[]")
        vectors = re.findall(r"\[([\d, ]+)\]", warp)
        return [[int(x) for x in vec.split(",")] for vec in vectors]
    if kind.group(1) == "blocked":
        per_warp = [a * b for a, b in zip(_ints(body, "sizePerThread"),
                                          _ints(body, "threadsPerWarp"), strict=True)]  # fmt: skip
        counts = _ints(body, "warpsPerCTA")
    elif kind.group(1) == "nvidia_mma":  # a warp covers 16 rows of an instruction's columns
        counts = _ints(body, "warpsPerCTA")
        per_warp = [16, _ints(body, "instrShape")[1]][: len(counts)]
    else:
        return None
    bases = []
    for axis, (count, step) in enumerate(zip(counts, per_warp, strict=True)):
        for bit in range(max(count.bit_length() - 1, 0)):
            vec = [0] * len(counts)
            vec[axis] = step << bit
            bases.append(vec)
    return bases


def warp_repeat(ttgir: str, warps: int) -> float:
    """The share of the floating-point operations' lanes (each operation weighted by its
    result's elements) that repeat another warp's elements: a warp bit whose offset is 0, or
    falls outside the tensor, doubles the copies."""
    aliases = dict(_ALIAS.findall(ttgir))
    total = repeated = 0.0
    for line in ttgir.splitlines():
        if not _FLOAT_OP.search(line) or "tensor<" not in line:
            continue
        start = line.rindex("tensor<") + len("tensor")
        shape_text, _, layout = _inner(line, start).partition(", ")
        dims = [int(x) for x in shape_text.split("x")[:-1]]
        bases = warp_bases(layout, aliases)
        if bases is None or not dims:
            continue
        distinct = sum(any(0 < b < n for b, n in zip(vec, dims, strict=True)) for vec in bases)
        copies = warps / 2**distinct
        size = math.prod(dims)
        total += size * copies
        repeated += size * (copies - 1)
    return repeated / total if total else 0.0


def occupancy(gpu: GPU, regs: int, shared: int, warps: int) -> tuple[int, float]:
    """Blocks per SM and the fraction of the SM's warps they hold: registers are allocated
    per warp in units of 256 within each of the four sub-partitions."""
    per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = (gpu.regs_per_sm // 4 // per_warp) * 4 // warps
    by_shared = gpu.smem_per_sm // max(shared, 1)
    blocks = min(by_regs, by_shared, gpu.max_warps // warps, gpu.max_blocks)
    return blocks, blocks * warps / gpu.max_warps


def analyse(launch: Launch, arch: int) -> dict[str, Any]:
    """One row of the report for ``launch`` compiled for ``arch``."""
    gpu = gpu_for(arch)
    compiled = compile_launch(launch, arch)
    cubin = compiled.asm["cubin"]
    usage = resource_usage(cubin)
    warps = compiled.metadata.num_warps
    shared = compiled.metadata.shared + max(usage.get("shared", 0), gpu.reserved_smem)
    blocks, occ = occupancy(gpu, usage["reg"], shared, warps)
    names = dict(zip(launch.fn.arg_names, launch.args, strict=False)) | launch.meta
    names = {k: v for k, v in names.items() if isinstance(v, (int, bool))}
    # a program that takes tiles in turn (``range(pid, TILES, programs)``): the first's count
    names |= {"pid": 0, "programs": math.prod(launch.grid)}
    code, labels = sass(cubin)
    source = inspect.getsourcefile(launch.fn.fn)
    found = loops(code, labels, names, source)
    counts = weighted_counts(code, found)
    programs = math.prod(launch.grid)
    by_line = {line: n * warps * programs for line, n in
               counts_by_line(code, found, source).items()}  # fmt: skip
    waves = programs / (gpu.sms * max(blocks, 1))
    warp_instructions = counts["instructions"] * warps * programs
    issue_s = warp_instructions / (gpu.sms * gpu.schedulers * gpu.clock_ghz * 1e9)
    if counts["mma"]:
        peak, unit = gpu.tf32_tflops, "tensor"
    elif launch.dtype == "float64":
        peak, unit = gpu.fp64_tflops, "fp64"
    else:
        peak, unit = gpu.fp32_tflops, "fp32"
    flop_s = launch.flops / (peak * 1e12)
    dram_s = launch.bytes / (gpu.dram_tbps * 1e12)
    return dict(
        layer=launch.layer, kernel=launch.kernel, dtype=launch.dtype, programs=programs,
        warps=warps, regs=usage["reg"], stack_bytes=usage.get("stack", 0),
        spill_instructions=sum(i.opcode.startswith(("LDL", "STL")) for i in code),
        shared_bytes=shared, blocks_per_sm=blocks, occupancy=occ, waves=waves,
        sass_instructions=len(code), loops=len(found),
        unknown_loops=sum(not lp.known for lp in found),
        warp_repeat=warp_repeat(compiled.asm["ttgir"], warps),
        instructions_per_program=counts["instructions"] * warps,
        atomics_per_program=counts["atomic"] * warps, barriers_per_program=counts["barrier"],
        mma_per_program=counts["mma"] * warps, warp_instructions=warp_instructions,
        flops=launch.flops, bytes=launch.bytes, flop_unit=unit, issue_ms=issue_s * 1e3,
        flop_ms=flop_s * 1e3, dram_ms=dram_s * 1e3,
        issue_over_bound=issue_s / max(flop_s, dram_s), source=source,
        warp_instructions_by_line=by_line,
    )  # fmt: skip


@contextlib.contextmanager
def _fresh_cache() -> Iterator[None]:
    """Compiles into an empty Triton cache: a cached binary's line information names the file
    and lines it was compiled from, which need not be today's sources (another checkout, an
    edit above the kernel), and the trip counts are read from those lines."""
    before = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="symattn-static-") as folder:
        os.environ["TRITON_CACHE_DIR"] = folder
        linecache.checkcache()
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = before


def measure(launch: Launch, device: str) -> dict[str, float]:
    """``launch`` run on the GPU ``device``: its median time in ms (CUDA events, the L2 cache
    flushed before each run: ``triton.testing.do_bench``)."""
    import torch
    from triton.testing import do_bench

    args = tuple(a.to(device) if torch.is_tensor(a) else a for a in launch.args)
    with torch.cuda.device(device):
        ms = do_bench(lambda: launch.fn[launch.grid](*args, **launch.meta), warmup=25, rep=100,
                      return_mode="median")  # fmt: skip
    return {"measured_ms": float(ms)}


Rows = list[dict[str, Any]]
MAX_REGISTERS = 255  # a thread's registers at most, on every architecture of GPUS


def _analyse_capped(launch: Launch, arch: int, max_registers: int) -> dict[str, Any]:
    """:func:`analyse`; a cap too small for the kernel is the caller's error, named with the
    least cap the assembler asks for."""
    try:
        return analyse(launch, arch)
    except Exception as err:
        need = re.search(r"register target of (\d+) or higher", str(err))
        if not max_registers or need is None:
            raise
        raise ConfigError(
            f"max_registers={max_registers} is too few for the {launch.layer} {launch.kernel} "
            f"kernel: the assembler needs at least {need.group(1)}; raise the cap"
        ) from None


def report(case, arch: int = 90, backend: str = "triton", device: str | None = None,
           launcher: ModuleType | None = None, lines: int = 0,
           max_registers: int = 0) -> tuple[Rows, Rows]:  # fmt: skip
    """The report's rows for every attention launch of ``case`` (forward and backward of each
    layer) by ``backend``'s kernels (those of ``launcher``, :func:`baseline_launchers`, if
    given), then a total row per kernel and fwd+bwd (times summed; occupancy the lowest).
    With a CUDA ``device`` each launch is also run there and timed (:func:`measure`):
    ``measured_ms``, and its ratios to the issue bound and to the larger of the FLOP and DRAM
    bounds. Second, the ``lines`` source lines of each kernel with the most warp instructions
    over all its launches (:func:`top_lines`; none for 0). ``max_registers`` > 0 compiles
    every launch with at most that many registers a thread (Triton's ``maxnreg``; what does
    not fit spills to local memory)."""
    gpu_for(arch)
    if not 0 <= max_registers <= MAX_REGISTERS:
        raise ConfigError(f"max_registers={max_registers}: a thread has at most "
                          f"{MAX_REGISTERS} registers; give a cap up to that, or 0 for the "
                          "compiler's choice")  # fmt: skip
    capped = {"maxnreg": max_registers} if max_registers else {}
    with _fresh_cache():
        rows = [_analyse_capped(launch, arch, max_registers)
                | ({} if device is None else measure(launch, device))
                for call in attention_calls(case)
                for launch in (replace(one, meta=one.meta | capped) for one in
                               launches(call, backend, gpu_for(arch).sms, launcher))]  # fmt: skip
    by_line = [(r["kernel"], r.pop("source"), r.pop("warp_instructions_by_line")) for r in rows]
    totals = []
    for kernel in ("forward", "backward", "fwd+bwd"):
        part = [r for r in rows if kernel in ("fwd+bwd", r["kernel"])]
        if not part:
            continue
        total = dict.fromkeys(rows[0], 0)
        total.update(layer="total", kernel=kernel, dtype=part[0]["dtype"],
                     flop_unit=",".join(sorted({r["flop_unit"] for r in part})))  # fmt: skip
        for key in ("programs", "warp_instructions", "flops", "bytes", "issue_ms", "flop_ms",
                    "dram_ms", "spill_instructions", "measured_ms"):  # fmt: skip
            if key in rows[0]:
                total[key] = sum(r[key] for r in part)
        for key in ("regs", "shared_bytes", "stack_bytes"):
            total[key] = max(r[key] for r in part)
        total["occupancy"] = min(r["occupancy"] for r in part)
        total["warp_repeat"] = max(r["warp_repeat"] for r in part)
        total["blocks_per_sm"] = min(r["blocks_per_sm"] for r in part)
        total["issue_over_bound"] = total["issue_ms"] / max(total["flop_ms"], total["dram_ms"])
        totals.append(total)
    for row in rows + totals:
        if "measured_ms" in row:
            row["measured_over_issue"] = row["measured_ms"] / row["issue_ms"]
            row["measured_over_bound"] = row["measured_ms"] / max(row["flop_ms"], row["dram_ms"])
    return rows + totals, top_lines(by_line, gpu_for(arch), lines)


def top_lines(by_line: list[tuple[str, str, dict[int, float]]], gpu: GPU,
              count: int) -> list[dict[str, Any]]:  # fmt: skip
    """Per kernel (forward, backward), the ``count`` lines of its source with the most warp
    instructions summed over its launches (``by_line``: (kernel, source file, warp
    instructions by line) per launch), most first: the line, its text, its share of the
    kernel's instructions and its part of the issue bound."""
    out: list[dict[str, Any]] = []
    for kernel in ("forward", "backward"):
        summed: dict[tuple[str, int], float] = {}
        for which, source, counts in by_line:
            if which == kernel:
                for line, n in counts.items():
                    summed[source, line] = summed.get((source, line), 0.0) + n
        everything = sum(summed.values())
        rate = gpu.sms * gpu.schedulers * gpu.clock_ghz * 1e6  # warp instructions a ms
        ranked = sorted(summed.items(), key=lambda item: -item[1])[:count]
        for (source, line), n in ranked:
            text = linecache.getline(source, line).strip() if line else "(no line of the kernel)"
            out.append(dict(kernel=kernel, file=Path(source).name, line=line, text=text,
                            warp_instructions=n, share=n / everything,
                            issue_ms=n / rate))  # fmt: skip
    return out


def assumptions(arch: int) -> str:
    """The peak figures the bounds assume, in one line."""
    gpu = gpu_for(arch)
    return (f"sm_{arch} as {gpu.name}: {gpu.sms} SMs, {gpu.schedulers} warp schedulers/SM at "
            f"{gpu.clock_ghz} GHz (issue), {gpu.fp32_tflops} TFLOP/s fp32, {gpu.fp64_tflops} "
            f"fp64, {gpu.tf32_tflops} tf32 tensor (dense), {gpu.dram_tbps} TB/s DRAM; "
            f"{gpu.regs_per_sm} registers, {gpu.max_warps} warps, {gpu.max_blocks} blocks, "
            f"{gpu.smem_per_sm // 1024} KiB shared memory per SM")  # fmt: skip
