"""``symattn benchmark``: measurement of one case, presets, exponent fits, the command end to end.

Nothing here asserts on speed: the machine is shared and timings are noise. The tests check
that every number is there, finite and in range, and that the run file holds the tables.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from symattn_cli.bench.measure import Case, Settings, measure_case, measure_fresh
from symattn_cli.bench.suite import (
    PRESETS,
    fit_power_law,
    growth_exponents,
    index_comparison,
    naive_comparison,
    reference_comparison,
    resolve,
    select_cases,
)
from symattn_cli.errors import ConfigError
from symattn_cli.nn.gsa import cpp as gsa_cpp
from symattn_cli.train.runfile import read_summary, read_table
from tests.helpers import read_wandb_file, run_symattn, threads

TINY = Case(kind="layer", name="gsa", group="r4", patch_size=3, image_size=6, batch=1)
FAST = Settings(repeats=2, warmup=1, threads=1)


# ---------------------------------------------------------------- fits on synthetic data


def test_power_law_fit_recovers_exponent_and_prefactor():
    rng = np.random.default_rng(0)
    xs = np.array([1, 2, 4, 8, 16], dtype=float)
    ys = 0.3 * xs**2.5 * np.exp(rng.normal(0, 0.01, xs.size))
    k, a, r2 = fit_power_law(xs, ys)
    assert k == pytest.approx(2.5, abs=0.03)
    assert a == pytest.approx(0.3, rel=0.05)
    assert 0.999 < r2 <= 1.0


def test_power_law_fit_needs_two_distinct_x():
    with pytest.raises(ValueError, match="two distinct"):
        fit_power_law([4, 4], [1.0, 2.0])


def _row(n: int, p: int, side: int, form: str, time_s: float) -> dict:
    return dict(status="ok", kind="layer", family="gsa", form=form, group_order=n,
                patch_size=p, image_size=side, batch=2, channels=20, heads=9,
                train_time_s=time_s, forward_time_s=time_s / 3, train_mem_mb=time_s,
                forward_mem_mb=time_s / 2)  # fmt: skip


def test_growth_exponents_fit_each_axis_per_series():
    rows = [_row(n, 5, 12, "sum", 1e-3 * n**2) for n in (1, 4, 8, 16)]
    rows += [_row(n, 5, 12, "single", 1e-3 * n) for n in (1, 4, 8, 16)]
    rows += [_row(8, p, 12, "sum", 1e-3 * 64 * (p / 5) ** 2) for p in (3, 7, 9)]  # P=5: above
    rows += [_row(8, 0, 12, "sum", 99.0)]  # global: not on the P axis
    rows += [_row(8, 5, s, "sum", 1e-3 * 64 * (s / 12) ** 2) for s in (6, 24)]
    rows += [dict(_row(4, 5, 12, "sum", 1.0), status="failed")]  # ignored
    fits = {(f["quantity"], f["axis"], f["series"]): f for f in growth_exponents(rows)}
    assert fits["train_time_s", "N", "layer gsa sum"]["exponent"] == pytest.approx(2.0)
    assert fits["train_time_s", "N", "layer gsa single"]["exponent"] == pytest.approx(1.0)
    assert fits["forward_time_s", "N", "layer gsa single"]["exponent"] == pytest.approx(1.0)
    p_fit = fits["train_time_s", "P", "layer gsa sum"]
    assert p_fit["exponent"] == pytest.approx(2.0) and p_fit["points"] == 4
    assert p_fit["x_min"] == 3 and p_fit["x_max"] == 9
    side = fits["train_time_s", "side", "layer gsa sum"]
    assert side["exponent"] == pytest.approx(2.0) and side["points"] == 3
    assert all(f["r2"] == pytest.approx(1.0) for f in fits.values())


def test_naive_comparison_pairs_rows_that_differ_only_in_form():
    ours = dict(_row(8, 5, 12, "sum", 0.5), group="r8")
    naive = dict(_row(8, 5, 12, "sum-naive", 5.0), group="r8", train_mem_mb=20.0)
    other_size = dict(_row(8, 5, 24, "sum-naive", 9.0), group="r8")  # no partner: ignored
    out = naive_comparison([ours, naive, other_size])
    assert out["r8_naive_train_time_ratio"] == pytest.approx(10.0)
    assert out["r8_naive_train_mem_ratio"] == pytest.approx(40.0)
    assert out["r8_naive_forward_time_ratio"] == pytest.approx(10.0)
    assert out["r8_naive_forward_mem_ratio"] == pytest.approx(10.0)


def test_index_comparison_pairs_each_index_with_relative():
    ours = dict(_row(8, 5, 12, "sum", 0.5), group="r8", group_index="relative")
    pair = dict(_row(8, 5, 12, "sum", 0.8), group="r8", group_index="pair")
    gevit = dict(_row(8, 5, 12, "sum", 0.7), group="r8", group_index="gevit")
    single = dict(_row(8, 5, 12, "single", 0.1), group="r8", group_index="pair")  # other form
    out = index_comparison([ours, pair, gevit, single])
    assert out["r8_pair_train_time_ratio"] == pytest.approx(1.6)
    assert out["r8_gevit_forward_time_ratio"] == pytest.approx(1.4)
    assert not any("single" in key for key in out) and len(out) == 8


# ---------------------------------------------------------------- presets and selection


def test_presets_resolve_and_reference_covers_the_issue_figures():
    for preset in PRESETS.values():
        infos = [resolve(case)[1] for case in preset.cases()]
        assert infos and len({i["label"] for i in infos}) == len(infos)  # no duplicates
    reference = [resolve(c)[1] for c in PRESETS["reference"].cases()]
    assert {(i["group"], i["batch"], i["patch_size"], i["form"]) for i in reference} == {
        ("z2", 2, 5, "sum"), ("z4", 2, 5, "sum"), ("r8", 2, 5, "sum")
    }  # fmt: skip


def test_gpu_preset_is_the_r8_net_in_both_forms_beside_its_baselines_per_batch():
    infos = [resolve(case)[1] for case in PRESETS["gpu"].cases()]
    for batch in (8, 32, 128):  # the paper's rotMNIST batch, and two a GPU fills better
        at = {(i["name"], i["form"]) for i in infos if i["batch"] == batch}
        assert at == {("r8_sa", "sum"), ("r8_sa", "single"), ("z2_sa", "sum"), ("cnn", "-")}
    assert all(i["image_size"] == 28 for i in infos)
    assert PRESETS["gpu"].modes[0] == "train"


def test_select_cases_filters_and_sets_axes():
    cases = PRESETS["sweep"].cases()
    only_r8 = select_cases(cases, groups=["r8"], layers=["gsa"])
    assert only_r8 and all(c.group == "r8" and c.kind == "layer" for c in only_r8)
    models = select_cases(cases, models=["r4_sa"], batch_sizes=[1, 4])
    assert {(c.name, c.batch) for c in models} == {("r4_sa", 1), ("r4_sa", 4)}
    collapsed = select_cases(cases, groups=["r4"], layers=["gsa"], patch_sizes=[3])
    assert {c.patch_size for c in collapsed} == {3}
    assert len(collapsed) == len({c.key() for c in collapsed})
    with pytest.raises(ConfigError, match="unknown group"):
        select_cases(cases, groups=["r5"])
    with pytest.raises(
        ConfigError, match=r"models=\['r9_sa'\]: unknown model 'r9_sa'; choose one of: .*r8_sa"
    ):
        select_cases(cases, models=["r9_sa"])
    with pytest.raises(ConfigError, match="gconv"):
        select_cases(cases, layers=["attention"])
    with pytest.raises(ConfigError, match=r"batch_sizes=\[4, 0\]: \[0\] below 1"):
        select_cases(cases, batch_sizes=[4, 0])
    with pytest.raises(ConfigError, match=r"image_sizes=\[-1\]: \[-1\] below 1"):
        select_cases(cases, image_sizes=[-1])


def test_global_attention_is_spelled_global_in_patch_sizes():
    """``patch_sizes=[3,global]``: global cases hold ``patch_size=None`` (as the layer does),
    their model override and label say global, their table row holds P = 0."""
    cases = PRESETS["sweep"].cases()
    chosen = select_cases(cases, groups=["r8"], models=["r8_sa"], patch_sizes=[3, "global"])
    assert {c.patch_size for c in chosen} == {3, None}
    wide = next(c for c in chosen if c.patch_size is None)
    resolved, info = resolve(wide)
    assert resolved.overrides["patch_size"] == "global" and "global" in info["label"]
    assert info["patch_size"] == 0
    for bad in (0, -1, "glob"):
        with pytest.raises(ConfigError, match=rf"patch_sizes: {bad!r} .* or global for global"):
            select_cases(cases, patch_sizes=[bad])


def test_attention_backends_measure_each_attention_case_once_per_backend():
    """``attention_backends=[triton,torch]``: the GPU preset's GSA nets with the Triton kernel
    and with the plain PyTorch core; the CNN once."""
    cases = select_cases(PRESETS["gpu"].cases(), models=["r8_sa", "cnn"], batch_sizes=[8],
                         attention_backends=["triton", "torch"])  # fmt: skip
    infos = [resolve(case)[1] for case in cases]
    assert sorted((i["name"], i["form"], i["attention_backend"]) for i in infos) == [
        ("cnn", "-", ""), ("r8_sa", "single", "torch"), ("r8_sa", "single", "triton"),
        ("r8_sa", "sum", "torch"), ("r8_sa", "sum", "triton"),
    ]  # fmt: skip
    assert len({i["label"] for i in infos}) == len(infos)
    model_case, _ = resolve(cases[0])
    assert model_case.overrides["attention_backend"] in ("triton", "torch")
    with pytest.raises(ConfigError, match=r"\['gpu'\] unknown; use any of .*triton"):
        select_cases(PRESETS["gpu"].cases(), attention_backends=["gpu"])


def test_reference_comparison_ratios():
    case, info = resolve(PRESETS["reference"].cases()[2])  # r8
    row = {"train_time_s": 0.7, "train_mem_mb": 215.5}
    out = reference_comparison(info, row)
    assert out["time_ratio"] == pytest.approx(20.0)
    assert out["mem_ratio"] == pytest.approx(20.0)
    assert out["meets_target"] == 1.0 and out["ref_source"] == "published"
    slow = reference_comparison(info, {"train_time_s": 7.0, "train_mem_mb": 100.0})
    assert slow["meets_target"] == 0.0
    _, layer = resolve(TINY)
    assert reference_comparison(layer, row) == {}


# ---------------------------------------------------------------- one case


def _check_row(row: dict, modes=("train", "forward")) -> None:
    assert row["params"] > 0 and row["gemm_gflops"] > 0
    for mode in modes:
        assert row[f"{mode}_time_s"] > 0 and row[f"{mode}_time_min_s"] > 0
        assert row[f"{mode}_time_min_s"] <= row[f"{mode}_time_s"]
        assert row[f"{mode}_time_iqr_s"] >= 0
        assert math.isfinite(row[f"{mode}_mem_mb"]) and row[f"{mode}_mem_mb"] >= 0
        assert row[f"{mode}_flops"] > 0
        assert 0 < row[f"{mode}_flop_fraction"] <= 1.5
        assert row[f"{mode}_items_per_s"] == pytest.approx(TINY.batch / row[f"{mode}_time_s"])


def test_measure_case_in_process_and_train_counts_more_flops():
    row = measure_case(TINY, FAST)
    _check_row(row)
    # Backward of every matrix product costs about twice its forward.
    assert 2.0 < row["train_flops"] / row["forward_flops"] <= 3.0


def test_in_process_cases_keep_the_thread_budget():
    """A GSA case spends the budget on attention threads (one intra-op thread while measured)
    and hands it back: the next in-process case starts from the same budget."""
    import torch

    with threads(2):
        settings = Settings(repeats=1, warmup=0, threads=0, modes=("train",), count_flops=False)
        first = measure_case(TINY, settings)
        assert torch.get_num_threads() == 2
        second = measure_case(TINY, settings)
        assert first["threads"] == second["threads"] == 2


def test_flop_count_counts_the_attention_arithmetic_whatever_the_backend():
    """The counter cannot see inside the fused kernel: the attention core is counted on its
    torch backend without recomputation (the same algorithm), whatever backend the layers run
    and however many threads; the warm-up step runs on the layer's own backend, and the
    layer is left as it was."""
    import torch

    from symattn_cli.bench.measure import build_case, count_flops
    from symattn_cli.nn.gsa.core import backend_for, recording

    case = Case(kind="layer", name="gsa", group="r8", patch_size=5, image_size=12, batch=2)
    module, x, loss = build_case(case, torch.device("cpu"))

    def step():
        loss(module(x)).backward()

    with threads(1), recording() as calls:
        serial = count_flops(step)
    assert [(c.backend, c.recompute) for c in calls] == [
        (backend_for("cpu", torch.float32), True), ("torch", False)
    ]  # fmt: skip
    assert module.attention_backend == "auto" and module.checkpointing
    with threads(2):
        assert count_flops(step) == serial > 0
        module.attention_backend = "torch"
        assert count_flops(step) == serial


def test_flop_count_keeps_saved_tensors_as_shapes_and_counts_the_same():
    """count_flops hands autograd's saved floating tensors back as zeros of their shapes (so
    a global layer's count fits in memory): the count equals a plain count of the torch
    backend, for a group term that depends on v (the largest saved tensors) and a small net."""
    from dataclasses import replace

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from symattn_cli.bench.measure import _step_fn, build_case, count_flops
    from symattn_cli.bench.suite import gsa_layer, gsa_model
    from symattn_cli.nn.gsa.core import overriding

    pair = replace(gsa_layer("r8", "sum", patch=None, side=4, batch=1), group_index="pair")
    for case in (pair, gsa_model("z2", batch=1, patch=3)):
        module, x, loss = build_case(case, torch.device("cpu"))
        _step_fn(module, x, loss, "train")()  # warm-up: the layers' geometry is built once
        with overriding("torch", recompute=False), FlopCounterMode(display=False) as plain:
            _step_fn(module, x, loss, "train")()
        counted = count_flops(_step_fn(module, x, loss, "train"))
        assert counted == plain.get_total_flops() > 0


def test_flop_count_of_the_reference_algorithm_counts_what_it_runs():
    """A layer on the reference algorithm (``attention_backend=dense``) does not call the
    core: it is plain PyTorch and counted as it runs, not as the factorised algorithm."""
    from dataclasses import replace

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from symattn_cli.bench.measure import _step_fn, build_case, count_flops
    from symattn_cli.bench.suite import gsa_layer

    dense = replace(gsa_layer("r4", "sum", patch=3, side=6, batch=1), attention_backend="dense")
    module, x, loss = build_case(dense, torch.device("cpu"))
    _step_fn(module, x, loss, "train")()
    with FlopCounterMode(display=False) as plain:
        _step_fn(module, x, loss, "train")()
    assert count_flops(_step_fn(module, x, loss, "train")) == plain.get_total_flops() > 0


def test_measure_case_runs_the_attention_backend_asked_for():
    settings = Settings(repeats=1, warmup=0, threads=1, modes=("train",), count_flops=False)
    row = measure_case(replace(TINY, attention_backend="torch"), settings)
    assert row["attention_backend"] == "torch" and row["train_time_s"] > 0


@pytest.mark.usefixtures("native_attention_core")
def test_measure_fresh_runs_in_a_child_process():
    settings = Settings(repeats=1, warmup=0, threads=1, modes=("train",), omp_wait_policy="passive")
    row = measure_fresh(TINY, settings)
    _check_row(row, modes=("train",))
    assert row["runtime_init_mb"] >= 0 and "forward_time_s" not in row
    assert row["omp_wait_policy"] == "PASSIVE" and row["train_cpu_s"] > 0
    # the child process found the C++ attention kernel (the test session built it)
    assert row["attention_backend"] == ("cpp" if gsa_cpp.enabled() else "torch")


def test_measure_fresh_reports_a_failed_case():
    bad = Case(kind="layer", name="gsa", group="r4", patch_size=4, image_size=6, batch=1)
    with pytest.raises(RuntimeError, match="patch_size=4"):
        measure_fresh(bad, Settings(repeats=1, warmup=0, threads=1))


# ---------------------------------------------------------------- the command


@pytest.mark.slow
@pytest.mark.usefixtures("native_attention_core")
def test_quick_preset_writes_tables_fits_plots_and_wandb(workdir: Path):
    out = workdir / "run"
    result = run_symattn(
        "benchmark", "preset=quick", "logger.mode=offline", f"hydra.run.dir={out}", cwd=workdir
    )
    assert result.returncode == 0, result.stderr
    path = out / "run.h5"
    assert "growth exponents" in result.stdout and f"run file: {path}" in result.stdout
    assert "attention backend cpp" in result.stdout or not gsa_cpp.enabled()

    cases = read_table(path, "cases")
    n = len(cases["label"])
    assert n == len(PRESETS["quick"].cases())
    assert set(cases["status"]) == {"ok"}
    for column in ("group_order", "patch_size", "image_size", "batch", "params",
                   "gemm_gflops", "runtime_init_mb"):  # fmt: skip
        assert cases[column].shape == (n,)
    assert "fwd+bwd img/s" in result.stdout
    for mode in ("train", "forward"):
        assert np.all(cases[f"{mode}_time_s"] > 0)
        assert np.allclose(cases[f"{mode}_items_per_s"], cases["batch"] / cases[f"{mode}_time_s"])
        assert np.all(cases[f"{mode}_time_iqr_s"] >= 0)
        assert np.all(cases[f"{mode}_mem_mb"] >= 0)
        assert np.all(cases[f"{mode}_flops"] > 0)
        fraction = cases[f"{mode}_flop_fraction"]
        assert np.all((fraction > 0) & (fraction <= 1.5))
    gsa = cases["family"] == "gsa"
    assert np.all(cases["train_mem_mb"][gsa] > 0)
    assert {"lifting", "sum", "single"} <= set(cases["form"][gsa])
    assert 0 in cases["patch_size"][gsa]  # global attention

    fits = read_table(path, "fits")
    assert {"N", "P", "side"} <= set(fits["axis"])
    assert np.all(np.isfinite(fits["exponent"])) and np.all(fits["points"] >= 2)

    summary = read_summary(path)
    assert summary["cases"] == n and summary["failed"] == 0 and summary["gemm_gflops"] > 0
    assert summary["z4_naive_train_time_ratio"] > 0 and summary["z4_naive_forward_mem_ratio"] > 0
    assert "reference algorithm (sum-naive) / ours (sum), z4 layer" in result.stdout

    for name in ("time_memory_vs_group", "time_memory_vs_patch", "time_memory_vs_side"):
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    wandb_files = list((out / "wandb").rglob("run-*.wandb"))
    assert len(wandb_files) == 1
    history = read_wandb_file(wandb_files[0])["history"]
    logged = {key: value for row in history for key, value in row.items()}
    assert logged["benchmark/cases/_type"] == '"table-file"'
    assert int(logged["benchmark/cases/nrows"]) == n
    assert int(logged["benchmark/fits/nrows"]) == len(fits["axis"])


def test_unknown_preset_is_one_line_and_exit_2(symattn, workdir: Path):
    result = symattn(
        "benchmark", "preset=fastest", "logger.mode=disabled", f"hydra.run.dir={workdir}",
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "preset='fastest'" in lines[0]
    assert all(name in lines[0] for name in PRESETS)
    assert not (workdir / "run.h5").exists()


@pytest.mark.usefixtures("native_attention_core")
def test_attention_backends_option_measures_each_backend(symattn, workdir: Path):
    """One command compares backends on one device: here the C++ kernel and the plain PyTorch
    core on the CPU (on a GPU: ``attention_backends=[triton,torch]``)."""
    out = workdir / "backends"
    backends = ["cpp", "torch"] if gsa_cpp.enabled() else ["torch"]
    result = symattn(
        "benchmark", "preset=quick", "groups=[z2]", "layers=[gsa]",
        f"attention_backends=[{','.join(backends)}]", "repeats=1", "warmup=0",
        "count_flops=false", "plot=false", "logger.mode=disabled", f"hydra.run.dir={out}",
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"attention backend {', '.join(backends)}" in result.stdout
    cases = read_table(out / "run.h5", "cases")
    assert cases["attention_backend"].tolist() == backends
    assert np.all(cases["train_items_per_s"] > 0)


def test_gpu_preset_on_the_cpu_says_what_it_costs_and_reports_throughput(symattn, workdir: Path):
    """Narrowed to the CNN at batch 1 (seconds); the note names the way out."""
    out = workdir / "gpu"
    result = symattn(
        "benchmark", "preset=gpu", "models=[cnn]", "batch_sizes=[1]", "repeats=1", "warmup=0",
        "count_flops=false", "plot=false", "logger.mode=disabled", f"hydra.run.dir={out}",
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "note: preset=gpu on the CPU" in result.stdout and "device=cuda" in result.stdout
    assert "fwd+bwd img/s" in result.stdout
    cases = read_table(out / "run.h5", "cases")
    assert cases["name"].tolist() == ["cnn"] and np.all(cases["train_items_per_s"] > 0)


def test_the_matched_preset_times_the_set_at_both_resolutions_over_the_p4cnn():
    from symattn_cli.bench.suite import PRESETS, resolve, step_ratios

    preset = PRESETS["matched"]
    assert preset.modes == ("step",) and preset.threads == 1
    infos = [resolve(case)[1] for case in preset.cases()]
    assert [i["label"] for i in infos] == [
        "gcnn_mini 28px b16", "cnn_mini 28px b16",
        "r4_mini input_pool=2 28px b16", "r4_mini input_pool=1 28px b16",
        "r8_mini input_pool=2 28px b16", "r8_mini input_pool=1 28px b16",
    ]  # fmt: skip
    # the nets as configured: their own group and neighbourhood, not the case's defaults
    assert [(i["group"], i["patch_size"]) for i in infos[2:4]] == [("z4", 3), ("z4", 3)]
    rows = [dict(info, status="ok", step_time_s=t) for info, t in
            zip(infos, (0.05, 0.01, 0.06, 0.2, 0.15, 0.8), strict=True)]  # fmt: skip
    ratios = step_ratios(rows, "gcnn_mini")
    assert ratios["gcnn_mini 28px b16_step_ratio"] == 1.0
    assert abs(ratios["r4_mini input_pool=1 28px b16_step_ratio"] - 4.0) < 1e-12


def test_a_training_step_is_split_into_its_parts():
    """The step mode: forward, backward and Adam, profiled by part; the parts of a GSA net's
    step include both kernel ranges and the optimizer."""
    from symattn_cli.bench.measure import Case, _step_fn, build_case, step_parts

    case = Case(kind="model", name="gsa_mini", image_size=28, batch=2, configured=True,
                overrides={"channels": 8, "heads": 2})  # fmt: skip
    module, x, loss = build_case(case, torch.device("cpu"))
    before = [p.detach().clone() for p in module.parameters()]
    parts = step_parts(_step_fn(module, x, loss, "step"), steps=1)
    assert {"attention kernel forward", "attention kernel backward", "optimizer"} <= set(parts)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


@pytest.mark.slow
def test_a_compiled_case_times_its_compilation_apart():
    from symattn_cli.bench.measure import Case, Settings, measure_case

    case = Case(kind="model", name="cnn", image_size=28, batch=2, configured=True,
                overrides={"channels": [4, 8]})  # fmt: skip
    row = measure_case(case, Settings(repeats=2, warmup=1, threads=1, modes=("step",),
                                      compile=True))  # fmt: skip
    assert row["compile_s"] > 0 and row["step_time_s"] > 0
    assert "step_flops" not in row  # FLOPs are counted on eager modules only
