"""Time, peak memory and FLOPs of one benchmark case, in this process or in a fresh one.

A *case* is one layer or one model (ours, or the authors' GSA-Net) at one size
(:class:`Case`). A *measurement* runs, for each mode, ``warmup`` untimed steps then
``repeats`` timed ones, and reports:

* time: median, inter-quartile range and minimum of the timed steps (seconds, wall clock;
  ``torch.cuda.synchronize`` around each step on CUDA), and the median CPU time of the process
  per step (all threads; on a busy machine wall time grows while CPU time stays put);
  throughput: the batch over the median time (``<mode>_items_per_s``, images per second);
* memory: the peak growth during the mode's steps (warm-up included) over a baseline taken
  after the module and its input exist. CPU: peak resident set size (``VmHWM``) minus the
  resident set before the first step, with the peak counter reset in between modes
  (``malloc_trim`` hands freed heap back, ``/proc/self/clear_refs`` ``5`` resets ``VmHWM``).
  CUDA: ``max_memory_allocated`` minus ``memory_allocated`` after ``reset_peak_memory_stats``;
* FLOPs: the multiply-adds of matrix products and convolutions (``mm``, ``bmm``, ``einsum``,
  ``conv``; 2 FLOPs per multiply-add) of one step, counted by
  ``torch.utils.flop_counter.FlopCounterMode`` with the attention's backward recomputation
  switched off (``checkpointing=False``), so a recomputed forward is not counted twice.
  Element-wise work (exp, softmax, norms) is not counted. Achieved FLOP/s is that count over
  the median time, and its fraction of the matrix-multiply throughput measured by
  :func:`matmul_gflops` in the same process just before the case. The authors' net is timed and
  measured but not counted.

Modes: ``forward`` is inference (``eval()``, ``torch.no_grad()``); ``train`` is a training step
(``train()``, forward + backward of a scalar loss, gradients dropped after each step).

One-off runtime initialisation is not charged to a case: before the first baseline a tiny
primer step (a convolution and a small group self-attention layer, forward and backward)
triggers the lazy imports and thread pools every process pays once. That growth is reported as
``runtime_init_mb``.

Threads: fresh processes start with OpenMP's own wait policy (its idle threads spin briefly,
then sleep) unless told otherwise (``Settings.omp_wait_policy``: ``passive`` suits a CPU
shared with other jobs); the policy in force is recorded with every row.

``python -m symattn_cli.bench.measure`` reads ``{"case": {...}, "settings": {...}}`` as JSON on
stdin and prints the result as one JSON line: :func:`measure_fresh` uses it so that every case
starts from a clean process.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from symattn_cli.options import (
    DEFAULT_ATTENTION_BACKEND,
    DEFAULT_GROUP_INDEX,
    DEFAULT_QUERY_FORM,
    GLOBAL,
)

# train: forward + backward; forward: inference; step: forward + backward + Adam, the
# training step, with its time per part (:data:`symattn_cli.train.profile.PARTS`)
MODES = ("train", "forward", "step")
LAYERS = ("gsa", "conv", "gconv")
MB = 1e6


@dataclass
class Case:
    """One thing to measure: a layer (``kind="layer"``), a registered model (``"model"``) or
    the authors' GSA-Net (``"authors"``).

    Layers: ``gsa`` (:class:`~symattn_cli.nn.gsa.GroupSelfAttention`, ``lifting`` or group,
    ``query_form`` sum | single, ``patch_size`` P or None for global, ``group_index`` the group
    term's index, pair | gevit | relative | shifted; ``attention_backend="dense"`` runs the
    reference algorithm, which materialises the full N^3 P^2 logit tensor: form
    ``sum-naive``), ``conv`` (``Conv2d`` with a ``patch_size`` kernel) and ``gconv`` (lifting /
    group convolution on ``group``). Models: ``name`` is a model name of ``symattn train
    model=...`` with ``overrides`` of its config. GSA layers and nets run their attention core
    on ``attention_backend``: auto (the device's default) | cpp | triton | triton_tiles | torch
    | dense. Choices and defaults: :mod:`symattn_cli.options`. The authors' net:
    ``name`` is the model it stands beside (``r8_sa``), ``group`` its group, ``overrides``
    ``{"code": <path of a checkout of github.com/dwromero/g_selfatt>}``.
    """

    kind: str = "layer"
    name: str = "gsa"
    group: str = "z2"
    lifting: bool = False
    query_form: str = DEFAULT_QUERY_FORM
    patch_size: int | None = 5  # None: global attention
    image_size: int = 28
    batch: int = 2
    channels: int = 20
    heads: int = 9
    group_index: str = DEFAULT_GROUP_INDEX  # GSA layers and nets
    attention_backend: str = DEFAULT_ATTENTION_BACKEND  # GSA layers and nets
    overrides: dict[str, Any] = field(default_factory=dict)
    # models: group, form, neighbourhood and index as the model's config has them (True), or
    # as this case sets them (False: the rotMNIST nets of the presets, swept over those axes)
    configured: bool = False
    # models: config folders besides the shipped ones (a user's --config-dir), file://<dir>
    search_path: list[str] = field(default_factory=list)

    @property
    def form(self) -> str:
        """``lifting``, ``sum`` or ``single`` for group layers; ``-`` otherwise."""
        if self.kind == "authors":
            return "sum"  # GSA-Nets Eq. 16, the form our ``sum`` form is named after
        if self.kind == "model":
            return self.query_form if self.name.endswith("_sa") else "-"
        if self.lifting:
            return "lifting"
        if self.name == "gsa" and self.attention_backend == "dense":
            return f"{self.query_form}-naive"
        return self.query_form if self.name == "gsa" else "group"

    @property
    def attends(self) -> bool:
        """Whether the case has our GSA attention (a GSA layer or net)."""
        if self.kind == "authors":
            return False
        return self.name == "gsa" if self.kind == "layer" else self.name.endswith("_sa")

    @property
    def label(self) -> str:
        size = f"{self.image_size}px b{self.batch}"
        patch = GLOBAL if self.patch_size is None else f"P{self.patch_size}"
        backend = (
            f" {self.attention_backend}"
            if self.attention_backend != DEFAULT_ATTENTION_BACKEND
            else ""
        )
        if self.kind == "authors":
            return f"authors {self.name} {patch} {size}"
        if self.kind == "model":
            extra = "".join(f" {k}={v}" for k, v in sorted(self.overrides.items()))
            if self.attends:  # GSA-Nets: their form, neighbourhood and group index matter
                index = "" if self.group_index == DEFAULT_GROUP_INDEX else f" {self.group_index}"
                extra = f" {self.query_form} {patch}{index}{extra}"
            return f"{self.name}{extra}{backend} {size}"
        index = f" {self.group_index}" if self.name == "gsa" and not self.lifting else ""
        return f"{self.name} {self.group} {self.form}{index} {patch}{backend} {size}"

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass
class Settings:
    repeats: int = 5
    warmup: int = 2
    threads: int = 0  # 0 = PyTorch's default
    device: str = "cpu"
    modes: tuple[str, ...] = MODES
    count_flops: bool = True
    seed: int = 0
    omp_wait_policy: str = ""  # for fresh processes: "" (library default) | passive | active
    kernel_baseline: str = ""  # a C++ kernel source to time ours against, step by step
    compile: bool = False  # torch.compile each case's module (warm-up steps compile it)


# ---------------------------------------------------------------- building a case


def model_case(
    name: str, image_size: int, overrides: dict[str, Any], search_path: list[str] = ()
) -> tuple[Any, int, int]:
    """``(model, in_channels, num_classes)`` of ``model=<name>`` (a shipped config or one on
    the command line's ``--config-dir``) on its natural data, at ``image_size``."""
    from omegaconf import open_dict

    from symattn_cli.errors import ConfigError
    from symattn_cli.models.instantiate import build_model, compose

    cfg = compose(name, search_path=search_path, **overrides)
    if cfg.data.task != "classify":
        raise ConfigError(
            f"models=[{name}]: the benchmark times image classifiers; {name} reads "
            f"{cfg.data.get('name', 'its data')} ({cfg.data.task}); train it with "
            "trainer.profile=true instead"
        )
    with open_dict(cfg.data):
        cfg.data.image_size = image_size
    return build_model(cfg.model), int(cfg.data.in_channels), int(cfg.data.num_classes)


def build_case(case: Case, device: Any) -> tuple[Any, Any, Callable[[Any], Any]]:
    """``(module, input, loss_fn)`` for ``case`` on ``device``, in fp32."""
    import torch

    from symattn_cli.groups import get_group

    if case.kind in ("model", "authors"):
        if case.kind == "authors":
            module = authors_net(
                case.overrides["code"], group=get_group(case.group),
                image_size=case.image_size, patch_size=case.patch_size,
            )  # fmt: skip
            channels, classes = 1, 10  # rotMNIST
        else:
            module, channels, classes = model_case(
                case.name, case.image_size, case.overrides, case.search_path
            )
        x = torch.randn(case.batch, channels, case.image_size, case.image_size)
        y = torch.randint(0, classes, (case.batch,), device=device)

        def loss(out):
            return torch.nn.functional.cross_entropy(out, y)

        return module.to(device), x.to(device), loss
    if case.kind != "layer" or case.name not in LAYERS:
        raise ValueError(f"unknown case {case.kind}/{case.name}; layers are {LAYERS}")
    group = get_group(case.group)
    c, side = case.channels, case.image_size
    if case.name == "gsa":
        from symattn_cli.nn.gsa import GroupSelfAttention

        module = GroupSelfAttention(
            group=group, in_channels=c, out_channels=c, heads=case.heads,
            patch_size=case.patch_size, lifting=case.lifting,
            query_form=case.query_form, attention_dropout=0.0, group_index=case.group_index,
            attention_backend=case.attention_backend,
        )  # fmt: skip
    elif case.name == "conv":
        module = torch.nn.Conv2d(c, c, case.patch_size, padding=case.patch_size // 2)
    else:
        from symattn_cli.models.gcnn import GroupConv, LiftingConv

        conv = LiftingConv if case.lifting else GroupConv
        module = conv(group=group, in_channels=c, out_channels=c, kernel_size=case.patch_size)
    on_group = case.name != "conv" and not case.lifting
    shape = (case.batch, c, group.order, side, side) if on_group else (case.batch, c, side, side)
    # A layer inside a network also back-propagates into its input (not the first one).
    x = torch.randn(*shape, device=device).requires_grad_(on_group or case.name == "conv")

    def loss(out):
        return out.square().mean()

    return module.to(device), x, loss


def authors_net(code: str, *, group: Any, image_size: int, patch_size: int) -> Any:
    """The authors' rotMNIST GSA-Net (their ``model.py``, dataset ``rotMNIST``, default
    options) on ``group``, imported from their checkout ``code``: ``SE2`` for rotations,
    ``E2`` with the flip, each with all ``group.order`` elements."""
    import warnings

    if code not in sys.path:
        sys.path.insert(0, code)
    try:
        with warnings.catch_warnings():  # their torch.cuda.amp.autocast: deprecated, off on CPU
            warnings.filterwarnings("ignore", message=".*autocast")
            import g_selfatt.groups as groups
            import models
        their_group = (groups.E2 if group.reflection else groups.SE2)(num_elements=group.order)
        return models.GroupTransformer(
            group=their_group, in_channels=1, num_channels=20, block_sizes=[2, 3],
            expansion_per_block=1, crop_per_layer=[2, 0, 2, 1, 1], image_size=image_size,
            num_classes=10, dropout_rate_after_maxpooling=0.0, maxpool_after_last_block=False,
            normalize_between_layers=False, patch_size=patch_size, num_heads=9,
            norm_type="LayerNorm", activation_function="Swish", attention_dropout_rate=0.1,
            value_dropout_rate=0.1, whitening_scale=1.0,
        )  # fmt: skip
    except Exception as err:  # their code failing is a failed row, also in process
        raise RuntimeError(f"the authors' code in {code}: {type(err).__name__}: {err}") from err


def parameter_count(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------- memory counters


def _status_kb(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field_name} line (Linux only)")


class CpuMemory:
    """Peak resident-set growth; the peak counter is reset by :meth:`start`."""

    def __init__(self) -> None:
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except OSError:  # not glibc: freed heap may stay resident (growth reads lower)
            self._trim = None
        self.resettable = True
        self._base = 0

    def start(self) -> None:
        gc.collect()
        if self._trim is not None:
            self._trim(0)
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
        except OSError:
            self.resettable = False
        self._base = _status_kb("VmRSS") * 1024

    def peak_growth(self) -> float:
        return max(_status_kb("VmHWM") * 1024 - self._base, 0)


class CudaMemory:
    """Peak allocated-memory growth on a CUDA device (PyTorch's caching allocator)."""

    resettable = True

    def __init__(self, device: Any) -> None:
        self.device = device
        self._base = 0

    def start(self) -> None:
        import torch

        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base = torch.cuda.memory_allocated(self.device)

    def peak_growth(self) -> float:
        import torch

        return max(torch.cuda.max_memory_allocated(self.device) - self._base, 0)


# ---------------------------------------------------------------- steps and counters


def _step_fn(module: Any, x: Any, loss_fn: Callable[[Any], Any], mode: str) -> Callable[[], None]:
    import torch

    if mode == "forward":
        module.eval()
        x_in = x.detach()  # no autograd metadata at all (FlopCounterMode's module hooks)

        def step() -> None:
            with torch.no_grad():
                module(x_in)

    elif mode == "step":
        module.train()
        optimizer = torch.optim.Adam([p for p in module.parameters() if p.requires_grad])
        record = torch.profiler.record_function

        def step() -> None:  # the trainer's ranges, so that a profile splits it the same way
            with record("train.forward"):
                loss = loss_fn(module(x))
            with record("train.backward"):
                loss.backward()
            with record("train.optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            x.grad = None

    else:
        module.train()

        def step() -> None:
            loss_fn(module(x)).backward()
            module.zero_grad(set_to_none=True)
            x.grad = None

    return step


def step_parts(step: Callable[[], None], steps: int = 3) -> dict[str, float]:
    """Seconds per step in each part of the training step (attention kernel forward and
    backward, 1x1 projections, layout copies, norms and activations, other step operators,
    optimizer), from a profile of ``steps`` steps; profiling slows each operator a little,
    so the parts say where the time goes, the timed median what it is."""
    from torch.profiler import ProfilerActivity, profile

    from symattn_cli.train.profile import charge, main_thread_spans

    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    parts = charge(main_thread_spans(prof))
    return {part: seconds / steps for part, seconds in parts.items() if seconds > 0}


def _sync(device: Any) -> Callable[[], None]:
    import torch

    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_steps(
    step: Callable[[], None], *, warmup: int, repeats: int, sync
) -> tuple[list[float], list[float]]:
    """Wall and process-CPU seconds of each of ``repeats`` steps after ``warmup`` ones."""
    for _ in range(warmup):
        step()
    sync()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        sync()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return wall, cpu


def summarize_times(times: list[float], cpu: list[float] | None = None) -> dict[str, float]:
    """Median, inter-quartile range and minimum of step times (and median CPU time)."""
    if len(times) >= 2:
        q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    else:
        q1 = q3 = times[0]
    out = {"time_s": statistics.median(times), "time_iqr_s": q3 - q1, "time_min_s": min(times)}
    if cpu:
        out["cpu_s"] = statistics.median(cpu)
    return out


def count_flops(step: Callable[[], None]) -> int:
    """Matrix-product and convolution FLOPs of one ``step``, without activation recomputation.

    The counter sees tensor operations, not the inside of a fused kernel: the attention core
    runs its plain PyTorch backend while counting (the same algorithm, the same products),
    without recomputation, whatever backend the layers ask for (the dispatcher's
    :func:`~symattn_cli.nn.gsa.core.overriding`; a layer on the reference algorithm,
    ``attention_backend="dense"``, is plain PyTorch and is counted as it runs). A FLOP count
    depends on shapes only, so the floating-point tensors autograd saves for the backward are
    kept as their shapes and handed back as zeros (integer ones, such as gather indices, are
    kept): the count's peak memory is one operation's, not the whole forward's, which a
    global layer would not fit. A warm-up step runs first, uncounted, as before a timing: a
    layer's one-time work (its kept geometry) is not part of a step.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from symattn_cli.nn.gsa.core import overriding

    def pack(tensor):
        if not tensor.is_floating_point():
            return tensor
        return tensor.shape, tensor.dtype, tensor.device

    def unpack(saved):
        if isinstance(saved, torch.Tensor):
            return saved
        shape, dtype, device = saved
        return torch.zeros((), dtype=dtype, device=device).expand(shape)

    step()  # warm-up, on the layers' own backends
    with overriding("torch", recompute=False):
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            with FlopCounterMode(display=False) as counter:
                step()
    return int(counter.get_total_flops())


def matmul_gflops(*, size: int = 1024, repeats: int = 5, device: Any = None) -> float:
    """Measured fp32 matrix-multiply throughput (median GFLOP/s of ``size``-square GEMMs)."""
    import torch

    device = torch.device(device or "cpu")
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    sync = _sync(device)
    times, _ = time_steps(lambda: torch.mm(a, b), warmup=2, repeats=repeats, sync=sync)
    return 2 * size**3 / statistics.median(times) / 1e9


# ---------------------------------------------------------------- one case


def prime_runtime(device: Any) -> float:
    """Pay the once-per-process costs (lazy imports, thread pools); returns the RSS growth."""
    import torch

    from symattn_cli.groups import get_group
    from symattn_cli.nn.gsa import GroupSelfAttention

    before = _status_kb("VmRSS") * 1024
    x = torch.randn(1, 2, 4, 6, 6, device=device, requires_grad=True)
    layer = GroupSelfAttention(group=get_group("z4"), in_channels=2, out_channels=6, heads=1,
                               patch_size=3).to(device)  # fmt: skip
    conv = torch.nn.Conv2d(2, 2, 3, padding=1).to(device)
    (layer(x).square().mean() + conv(x[:, :, 0]).mean()).backward()
    with torch.no_grad():
        conv(x[:, :, 0])
    return max(_status_kb("VmRSS") * 1024 - before, 0) / MB


def _attention_backend(module: Any, device: Any) -> str:
    """The attention core's backend in ``module`` on ``device`` ("" without attention)."""
    from symattn_cli.nn.gsa.core import attention_backends

    return attention_backends(module, device)


def measure_case(case: Case, settings: Settings) -> dict[str, Any]:
    """Measure ``case`` in this process; returns one result row (see the module docstring).
    The process's torch thread count is restored afterwards."""
    import torch

    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    budget = torch.get_num_threads()
    try:
        return _measure(case, settings, budget)
    finally:
        torch.set_num_threads(budget)


def _measure(case: Case, settings: Settings, budget: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(settings.seed)
    device = torch.device(settings.device)
    init_mb = prime_runtime(device)
    gemm = matmul_gflops(device=device)
    module, x, loss_fn = build_case(case, device)
    compile_s = 0.0
    if settings.compile:  # the first step compiles: timed apart, as start-up
        module = torch.compile(module)
        started = time.perf_counter()
        for mode in settings.modes:
            _step_fn(module, x, loss_fn, mode)()
        compile_s = time.perf_counter() - started
    memory = CudaMemory(device) if device.type == "cuda" else CpuMemory()
    sync = _sync(device)
    row: dict[str, Any] = {
        "params": parameter_count(module),
        "gemm_gflops": gemm,
        "runtime_init_mb": init_mb,
        "threads": budget,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "attention_backend": _attention_backend(module, device),
        "device": str(device),
        "compile_s": compile_s,
    }
    for mode in settings.modes:
        step = _step_fn(module, x, loss_fn, mode)
        memory.start()
        times, cpu = time_steps(step, warmup=settings.warmup, repeats=settings.repeats, sync=sync)
        row[f"{mode}_mem_mb"] = memory.peak_growth() / MB
        for key, value in summarize_times(times, cpu).items():
            row[f"{mode}_{key}"] = value
        row[f"{mode}_items_per_s"] = case.batch / row[f"{mode}_time_s"]  # images or sequences
        if mode == "step":  # where the step's time goes, per part: step_part_<part>_s
            for part, seconds in step_parts(step).items():
                row[f"step_part_{part.replace(' ', '_')}_s"] = seconds
    if settings.kernel_baseline and "cpp" in row["attention_backend"]:
        row.update(against_baseline(module, x, loss_fn, settings, sync))
    if not memory.resettable:  # only the first mode's peak is its own
        for mode in settings.modes[1:]:
            row[f"{mode}_mem_mb"] = float("nan")
    if settings.count_flops and case.kind != "authors" and not settings.compile:
        for mode in settings.modes:
            try:  # without recomputation a big case may not fit: keep its timings anyway
                flops = count_flops(_step_fn(module, x, loss_fn, mode))
            except (MemoryError, RuntimeError) as err:  # CUDA OOM is a RuntimeError
                row["flops_error"] = str(err).splitlines()[0] if str(err) else type(err).__name__
                continue
            rate = flops / row[f"{mode}_time_s"] / 1e9
            row[f"{mode}_flops"] = flops
            row[f"{mode}_gflops"] = rate
            row[f"{mode}_flop_fraction"] = rate / gemm
    return row


def against_baseline(module, x, loss_fn, settings: Settings, sync) -> dict[str, float]:
    """Each mode's step on the C++ kernel built from ``settings.kernel_baseline`` and on the
    shipped one, in this process, alternated step by step (``repeats`` rounds, each timing one
    step of each, in turn first) after ``warmup`` steps of each: ``<mode>_baseline_time_s``,
    the baseline's median, and ``<mode>_time_vs_baseline``, ours over it."""
    from pathlib import Path

    from symattn_cli.nn.gsa import cpp

    kernels = {"ours": cpp.load(), "baseline": cpp.load_source(Path(settings.kernel_baseline))}
    out: dict[str, float] = {}
    for mode in settings.modes:
        step = _step_fn(module, x, loss_fn, mode)
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for kernel in kernels.values():
            with cpp.using(kernel):
                time_steps(step, warmup=settings.warmup, repeats=0, sync=sync)
        for round_ in range(settings.repeats):
            for name in list(kernels)[:: 1 if round_ % 2 == 0 else -1]:
                with cpp.using(kernels[name]):
                    times[name] += time_steps(step, warmup=0, repeats=1, sync=sync)[0]
        base = statistics.median(times["baseline"])
        out[f"{mode}_baseline_time_s"] = base
        out[f"{mode}_time_vs_baseline"] = statistics.median(times["ours"]) / base
    return out


def measure_fresh(case: Case, settings: Settings, *, timeout: float | None = None) -> dict:
    """:func:`measure_case` in a fresh Python process; raises ``RuntimeError`` on failure."""
    request = json.dumps({"case": asdict(case), "settings": asdict(settings)})
    env = dict(os.environ)
    if settings.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = settings.omp_wait_policy.upper()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "symattn_cli.bench.measure"],
            input=request,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{case.label}: no result within {timeout:.0f} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["killed"])[-1]
        raise RuntimeError(f"{case.label}: exit {done.returncode}: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child() -> None:
    request = json.loads(sys.stdin.read())
    settings = request["settings"]
    settings["modes"] = tuple(settings["modes"])
    row = measure_case(Case(**request["case"]), Settings(**settings))
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    _child()
