"""``symattn benchmark``: time, peak memory and FLOPs of layers and models.

``preset=reference`` reproduces the GSA-Net issue's measurement (rotMNIST z2/r4/r8 nets,
batch 2, fp32, forward + backward) and prints the ratios to the reference implementation:
the authors' nets measured beside ours from a checkout of their code (``reference_code``),
else their published figures;
``preset=default`` (no arguments) answers in about a minute: the default model's training
step, one layer per form, and the R4 net at full resolution over the P4CNN; ``preset=matched``
times the matched set's training step at 14x14 and 28x28 with its parts; ``preset=sweep``
sweeps group order, neighbourhood, image and batch size, both group-layer forms and the
convolutional baselines; ``preset=gpu device=cuda`` measures the r8 net's
training-step throughput (images per second) and memory at batches 8, 32 and 128 beside the
z2 net and the plain CNN (``attention_backends=[auto,triton,torch]``: each GSA net with each
attention backend named); ``preset=gpu-static`` needs no GPU: it compiles the Triton kernels
for ``arch`` at the r8 net's sizes and prints per kernel the registers, occupancy, weighted
instruction counts and three lower bounds on the time (:mod:`symattn_cli.bench.static`), and
with ``device=cuda`` each launch's measured time beside them; ``preset=quick`` takes seconds
(tests).

Writes ``<run dir>/run.h5`` with tables ``/results/cases`` (one row per case), ``/results/fits``
(growth exponents) and ``/results/reference`` (the cases the reference was measured on), PNG
plots in the run directory, and the same tables to Weights & Biases. What is measured and how:
:mod:`symattn_cli.bench.measure`.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from typing import Any

from symattn_cli.commands.common import (
    device_name,
    environment,
    hydra_entry,
    run_dir,
    start_run_tracker,
    to_yaml,
)
from symattn_cli.errors import ConfigError

RUN_FILE = "run.h5"


def _settings(cfg: Any, preset: Any):
    """Measurement settings: the config's values where given, else the preset's."""
    from symattn_cli.bench.measure import MODES, Settings

    def pick(value, default):
        return default if value is None else value

    modes = tuple(cfg.modes) or preset.modes
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ConfigError(f"modes={list(cfg.modes)}: {bad} unknown; use any of {list(MODES)}")
    settings = Settings(
        repeats=pick(cfg.repeats, preset.repeats),
        warmup=pick(cfg.warmup, preset.warmup),
        threads=pick(cfg.threads, preset.threads),
        device=_device(cfg.device),
        modes=modes,
        count_flops=cfg.count_flops,
        seed=cfg.seed,
        omp_wait_policy=cfg.omp_wait_policy,
        compile=cfg.compile,
    )
    if cfg.omp_wait_policy.lower() not in ("passive", "active", ""):
        raise ConfigError(
            f"omp_wait_policy={cfg.omp_wait_policy!r}; use passive, active or '' (library default)"
        )
    if settings.repeats < 1 or settings.warmup < 0 or settings.threads < 0:
        raise ConfigError(
            f"repeats={settings.repeats}, warmup={settings.warmup}, threads={settings.threads}:"
            " need repeats >= 1, warmup >= 0, threads >= 0"
        )
    return settings


def _kernel_source(value: str, device: str, directory) -> str:
    """The C++ kernel source that ``kernel_baseline=`` names: a file, or the kernel's source at a
    git revision of this checkout, written into the run directory."""
    from pathlib import Path

    from symattn_cli.bench.revision import copy_at
    from symattn_cli.nn.gsa.cpp import SOURCE

    if device != "cpu":
        raise ConfigError(f"kernel_baseline={value!r} times the C++ kernel: use device=cpu")
    if Path(value).is_file():
        return str(Path(value).resolve())
    try:
        return str(copy_at(SOURCE, value, directory))
    except ValueError as err:
        raise ConfigError(
            f"kernel_baseline={value!r} is neither a file nor a git revision of this checkout "
            f"({err}); give a cpp_kernel.cpp path or a commit such as HEAD~1"
        ) from None


def _device(name: str) -> str:
    import torch

    if name == "cpu":
        return name
    if not name.startswith("cuda"):
        raise ConfigError(f"device={name!r} is unknown; use cpu or cuda (cuda:<index>)")
    if not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but no CUDA GPU is visible; use device=cpu")
    return name


def run_cases(cases, infos, settings, *, fresh: bool, timeout: float) -> list[dict[str, Any]]:
    """Measure every case; a failed case becomes a row with its status and error."""
    from symattn_cli.bench.measure import measure_case, measure_fresh
    from symattn_cli.bench.suite import reference_comparison

    rows = []
    for index, (case, info) in enumerate(zip(cases, infos, strict=True), start=1):
        row: dict[str, Any] = dict(info)
        try:
            if fresh:
                result = measure_fresh(case, settings, timeout=timeout)
            else:
                result = measure_case(case, settings)
            row.update(result, status="ok", error="")
        except TimeoutError as err:
            row.update(status="timeout", error=str(err))
        except (RuntimeError, ValueError, MemoryError) as err:
            row.update(status="failed", error=str(err).splitlines()[-1] if str(err) else "")
        rows.append(row)
        print(f"[{index}/{len(cases)}] {_line(row, settings.modes)}", flush=True)
    authors = {row["group"]: row for row in rows
               if row["kind"] == "authors" and row["status"] == "ok"}  # fmt: skip
    for info, row in zip(infos, rows, strict=True):
        if row["status"] == "ok":
            row.update(reference_comparison(info, row, authors.get(info["group"])))
    return rows


MODE_NAMES = {"train": "fwd+bwd", "forward": "fwd", "step": "step"}


def _line(row: dict[str, Any], modes) -> str:
    if row["status"] != "ok":
        return f"{row['label']}: {row['status']}: {row['error']}"
    parts = [
        f"{MODE_NAMES[m]} {row[f'{m}_time_s']:.4f} s "
        f"(cpu {row[f'{m}_cpu_s']:.4f} s) {row[f'{m}_mem_mb']:.1f} MB"
        + (
            f", {row[f'{m}_time_vs_baseline']:.3f}x the baseline kernel's time"
            if f"{m}_time_vs_baseline" in row
            else ""
        )  # fmt: skip
        for m in modes
    ]
    return f"{row['label']}: " + ", ".join(parts)


def benchmark(cfg: Any) -> dict[str, Any]:
    """Run the benchmark described by ``cfg``; returns the summary."""
    if cfg.omp_wait_policy and "OMP_WAIT_POLICY" not in os.environ:
        # Read once, when OpenMP starts (first torch import): set it before that.
        os.environ["OMP_WAIT_POLICY"] = cfg.omp_wait_policy.upper()
    from symattn_cli.bench.suite import (
        check_reference_code,
        get_preset,
        growth_exponents,
        index_comparison,
        naive_comparison,
        resolve,
        select_cases,
        step_ratios,
        with_authors,
    )

    preset = get_preset(cfg.preset)  # a wrong name fails before anything heavy loads
    if preset.name == "gpu-static":
        return static_report(cfg, preset)
    import torch
    from rich.console import Console

    from symattn_cli.bench import report
    from symattn_cli.bench.measure import matmul_gflops
    from symattn_cli.nn.gsa.core import backend_for
    from symattn_cli.train.runfile import write_results_file

    settings = _settings(cfg, preset)
    fresh = preset.fresh_process if cfg.fresh_process is None else cfg.fresh_process
    cases = select_cases(
        preset.cases(),
        groups=list(cfg.groups),
        models=list(cfg.models),
        layers=list(cfg.layers),
        batch_sizes=list(cfg.batch_sizes),
        image_sizes=list(cfg.image_sizes),
        patch_sizes=list(cfg.patch_sizes),
        attention_backends=list(cfg.attention_backends),
    )
    if not cases:
        raise ConfigError(f"preset={cfg.preset} has no case left after the filters; relax them")
    resolved = [resolve(case) for case in cases]  # bad names fail here, before any timing
    code = check_reference_code(cfg.reference_code) if cfg.reference_code else ""
    if code:
        resolved = with_authors(resolved, code)
    cases, infos = [c for c, _ in resolved], [i for _, i in resolved]

    directory = run_dir()
    if cfg.kernel_baseline:
        settings = replace(
            settings,
            kernel_baseline=_kernel_source(cfg.kernel_baseline, settings.device, directory),
        )
    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    gemm = matmul_gflops(device=settings.device)
    auto = backend_for(settings.device)  # builds the C++ kernel here, not in a timed case

    def named(backend: str) -> str:  # auto may pick another backend for lifting layers
        group, lifting = (backend_for(settings.device, backend=backend, grouped=grouped)
                          for grouped in (True, False))  # fmt: skip
        return group if group == lifting else f"{group} (lifting layers: {lifting})"

    asked = [named(b) for b in cfg.attention_backends] or [named("auto")]
    backends = ", ".join(dict.fromkeys(asked))
    print(
        f"benchmark preset={preset.name}: {len(cases)} cases, {settings.repeats} repeats after "
        f"{settings.warmup} warm-up, modes {list(settings.modes)}, device {settings.device} "
        f"({device_name(settings.device)}), "
        f"{torch.get_num_threads()} threads, {'fresh process per case' if fresh else 'in process'}"
        f"; fp32 GEMM {gemm:.1f} GFLOP/s; attention backend {backends}",
        flush=True,
    )
    if code:
        print(f"reference: the authors' nets, measured beside ours from their code in {code}",
              flush=True)  # fmt: skip
    if auto != "cpp" and settings.device == "cpu":
        print(
            "note: the GSA attention runs its plain PyTorch backend (SYMATTN_CPP=0, or the "
            "C++ kernel did not build: see the warning above); its times are not the kernel's",
            flush=True,
        )
    if preset.name == "gpu" and settings.device == "cpu":
        print(
            "note: preset=gpu on the CPU: a training step of the r8 net at batch 128 takes tens "
            "of seconds here; add device=cuda, or batch_sizes=[8] for a CPU figure",
            flush=True,
        )
    load_before = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    if settings.device == "cpu" and load_before > cores:
        print(
            f"note: load average {load_before:.1f} on {cores} cores: other processes compete "
            "for the CPU, so wall times are inflated (compare the cpu_s columns)",
            flush=True,
        )
    started = time.perf_counter()
    rows = run_cases(cases, infos, settings, fresh=fresh, timeout=cfg.case_timeout)
    elapsed = time.perf_counter() - started
    fits = growth_exponents(rows)
    reference = [row for row in rows if "time_ratio" in row]

    summary: dict[str, float] = {
        "cases": float(len(rows)),
        "failed": float(sum(row["status"] != "ok" for row in rows)),
        "gemm_gflops": gemm,
        "seconds": elapsed,
        "load_avg_start": load_before,
        "load_avg_end": os.getloadavg()[0],
    }
    summary.update(naive_comparison(rows))
    summary.update(step_ratios(rows, "gcnn_mini"))
    summary.update(index_comparison(rows))
    for row in reference:
        summary[f"{row['group']}_time_ratio"] = row["time_ratio"]
        summary[f"{row['group']}_mem_ratio"] = row["mem_ratio"]
    tables = {"cases": rows}
    if fits:
        tables["fits"] = fits
    if reference:
        tables["reference"] = reference
    path = write_results_file(
        directory / RUN_FILE,
        command="benchmark",
        config_yaml=to_yaml(cfg),
        env=environment(settings.device),
        tables=tables,
        summary=summary,
    )
    plots = []
    if cfg.plot:
        from symattn_cli.bench.plots import plot_all

        plots = plot_all(rows, directory)

    tracker = start_run_tracker(cfg, directory, name=directory.name, job_type="benchmark")
    exit_code = 1
    try:
        for name, table in tables.items():
            tracker.log_table(f"benchmark/{name}", table)
        tracker.summary(summary)
        exit_code = 0
    finally:
        tracker.finish(exit_code=exit_code)

    console = Console(width=None if sys.stdout.isatty() else 250)  # files: no wrapping
    console.print(report.cases_table(rows, settings.modes))
    if "step" in settings.modes:
        console.print(report.step_table(rows, "gcnn_mini"))
    if fits:
        console.print(report.fits_table(fits))
    naive = {k: v for k, v in summary.items() if "_naive_" in k}
    if naive:
        console.print(report.naive_line(naive))
    by_index = {k: v for k, v in summary.items() if k.endswith("_ratio")
                and ("_pair_" in k or "_gevit_" in k)}  # fmt: skip
    if by_index:
        console.print(report.index_lines(by_index))
    if reference:
        console.print(report.reference_table(reference))
    console.print(f"finished in {elapsed:.1f} s; run file: {path}")
    for plot in plots:
        console.print(f"plot: {plot}")
    return summary


def static_report(cfg: Any, preset: Any) -> dict[str, Any]:
    """``preset=gpu-static``: the Triton kernels compiled for ``arch`` at each case's sizes,
    read back from their machine code (:mod:`symattn_cli.bench.static`); nothing runs."""
    if "triton" not in sys.modules:  # compiled, not interpreted, whatever the environment says
        os.environ["TRITON_INTERPRET"] = "0"
    from rich.console import Console

    from symattn_cli.bench import report, static
    from symattn_cli.bench.suite import gsa_model, resolve, select_cases
    from symattn_cli.nn.gsa import triton as gsa_triton
    from symattn_cli.train.runfile import write_results_file

    if not gsa_triton.available():
        raise ConfigError("preset=gpu-static compiles the Triton kernels: install triton")
    if gsa_triton.interpreted():
        raise ConfigError(f"preset=gpu-static compiles for a GPU: set {gsa_triton.ENV}=0")
    static.gpu_for(cfg.arch)
    if cfg.lines < 0:
        raise ConfigError(f"lines={cfg.lines}: give how many source lines of each kernel to "
                          "list, or 0 for none")  # fmt: skip
    device = None if cfg.device == "cpu" else _device(cfg.device)
    if device is not None:  # also run each launch there, compiled for the same architecture
        import torch

        major, minor = torch.cuda.get_device_capability(device)
        if major * 10 + minor != cfg.arch:
            raise ConfigError(
                f"device={cfg.device} is sm_{major}{minor} but arch={cfg.arch}: set "
                f"arch={major}{minor} to time the kernels compiled for it"
            )
    cases = preset.cases()
    if cfg.groups:  # the rotMNIST net of each group named, in the sum form
        cases = [gsa_model(group, batch=cases[0].batch) for group in cfg.groups]
    cases = select_cases(cases, models=list(cfg.models),
                         batch_sizes=list(cfg.batch_sizes), image_sizes=list(cfg.image_sizes),
                         patch_sizes=list(cfg.patch_sizes))  # fmt: skip
    cases = [resolve(case)[0] for case in cases if case.attends]
    if not cases:
        raise ConfigError("preset=gpu-static has no GSA case left after the filters; relax them")
    directory = run_dir()
    started = time.perf_counter()
    console = Console(width=None if sys.stdout.isatty() else 250)
    timed = "not run" if device is None else f"each launch also timed on {device_name(device)}"
    print(f"benchmark preset=gpu-static: {len(cases)} cases compiled for sm_{cfg.arch} "
          f"({timed}); the bounds are estimates; {static.assumptions(cfg.arch)}",
          flush=True)  # fmt: skip
    backends = list(cfg.attention_backends) or ["triton"]
    for backend in backends:
        if backend not in static.KERNELS:
            raise ConfigError(f"attention_backends: {backend!r} has no Triton kernel; choose "
                              f"from {', '.join(static.KERNELS)}")  # fmt: skip
    # the Triton kernels of another revision, each beside today's: {backend: launcher}
    baseline = {}
    if cfg.kernel_baseline:
        baseline = static.baseline_launchers(cfg.kernel_baseline, run_dir())
    rows, line_rows, summary, totals = [], [], {}, {}
    for index, case in enumerate(cases):
        for which, backend in enumerate(backends):
            versions = {backend: None}
            if baseline:
                versions[f"{backend}@{cfg.kernel_baseline}"] = baseline[backend]
            version_totals = {}
            for version, launcher in versions.items():
                label = f"{case.name} {case.query_form} {case.group_index} b{case.batch} {version}"
                found, lines = static.report(case, cfg.arch, backend, device, launcher,
                                             cfg.lines, cfg.max_registers)  # fmt: skip
                case_rows = [{"case": label, "attention_backend": version, **row}
                             for row in found]  # fmt: skip
                rows += case_rows
                console.print(report.static_table(case_rows, f"{label}, sm_{cfg.arch}"))
                if lines:
                    line_rows += [{"case": label, "attention_backend": version, **row}
                                  for row in lines]  # fmt: skip
                    title = f"{label}: the source lines with the most instructions"
                    console.print(report.static_lines_table(lines, title))
                unknown = [f"{r['layer']} {r['kernel']}" for r in case_rows if r["unknown_loops"]]
                if unknown:  # counted as if run once: those instruction counts are too low
                    console.print("loops of unknown trip count, counted once: "
                                  + ", ".join(unknown))  # fmt: skip
                for row in case_rows:
                    if row["layer"] != "total":
                        continue
                    kernel = row["kernel"].replace("+", "_")
                    key = (f"case{index}_" + ("baseline_" if launcher else "")
                           + (f"{backend}_" if which else "") + kernel)  # fmt: skip
                    for column in ("issue_ms", "flop_ms", "dram_ms", "spill_instructions",
                                   "measured_ms"):  # fmt: skip
                        if column in row:
                            summary[f"{key}_{column}"] = row[column]
                    summary[f"{key}_min_occupancy"] = row["occupancy"]
                    if launcher is None:
                        totals[index, backend, row["kernel"]] = row["issue_ms"]
                    version_totals[version, row["kernel"]] = row
            if baseline:  # the other revision over today's, per kernel and fwd+bwd
                old, new = list(versions)[1], backend
                for column, what in (("issue_ms", "issue bound"), ("measured_ms", "measured")):
                    if column not in version_totals[new, "fwd+bwd"]:
                        continue
                    parts = []
                    for kernel in ("forward", "backward", "fwd+bwd"):
                        then, now = version_totals[old, kernel], version_totals[new, kernel]
                        parts.append(f"{kernel} {then[column] / now[column]:.2f}x")
                    console.print(f"{what}, {old} over today's {new}: {', '.join(parts)}")
        if len(backends) > 1:  # side by side: each backend's issue bound over the first's
            first = backends[0]
            for backend in backends[1:]:
                ratios = ", ".join(
                    f"{kernel} {totals[index, first, kernel] / totals[index, backend, kernel]:.2f}x"
                    for kernel in ("forward", "backward", "fwd+bwd"))  # fmt: skip
                console.print(f"issue bound, {first} over {backend}: {ratios}")
    summary.update(cases=float(len(cases)), arch=float(cfg.arch),
                   seconds=time.perf_counter() - started)  # fmt: skip
    tables = {"static": rows} | ({"static_lines": line_rows} if line_rows else {})
    path = write_results_file(directory / RUN_FILE, command="benchmark", config_yaml=to_yaml(cfg),
                              env=environment(device or "cpu"), tables=tables,
                              summary=summary)  # fmt: skip
    console.print(f"finished in {summary['seconds']:.1f} s; run file: {path}")
    return summary


def _task(cfg: Any) -> None:
    benchmark(cfg)


main = hydra_entry("benchmark", _task)
