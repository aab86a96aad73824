"""``symattn benchmark preset=gpu-static``: the Triton kernels compiled for a GPU without one,
read back from their machine code. The figures are estimates; the tests check the arithmetic
of the occupancy and the loop weighting, and that the command reports every launch."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from symattn_cli.bench import static
from symattn_cli.errors import ConfigError
from symattn_cli.train.runfile import read_summary, read_table
from tests.helpers import run_symattn


def test_occupancy_follows_the_register_and_warp_limits():
    h100 = static.GPUS[90]
    # 146 registers: 19 x 256 per warp, 3 warps per sub-partition: 3 blocks of 4 warps
    assert static.occupancy(h100, 146, 1536, 4) == (3, 12 / 64)
    assert static.occupancy(h100, 32, 1536, 4) == (16, 1.0)  # the warp limit
    assert static.occupancy(h100, 32, 100 * 1024, 4) == (2, 8 / 64)  # shared memory


def test_trip_counts_come_from_the_for_statement(tmp_path: Path):
    source = tmp_path / "kernel.py"
    source.write_text("for j0 in range(0, J, BJ):\n    for ch in range(d):  # a comment\n"
                      "        x = 1\n")  # fmt: skip
    names = {"J": 25, "BJ": 16, "d": 10}
    assert static._trip_count((str(source), 1), names) == 2
    assert static._trip_count((str(source), 2), names) == 10
    assert static._trip_count((str(source), 3), names) is None


def test_unrolled_loops_share_the_trip_count(tmp_path: Path):
    """A loop of 10 trips unrolled 4 times: its copy runs twice, the remainder twice; the
    instruction inside both, under the outer loop of 2, count 2 * (4 * 2 + 2) times."""
    source = tmp_path / "kernel.py"
    source.write_text("for j0 in range(0, J, BJ):\n    for ch in range(d):\n        x = 1\n")
    outer, inner = (str(source), 1), (str(source), 2)
    ins = static.Instruction
    code = [ins(0x00, "MOV", None, None)]
    code += [ins(0x10 + 0x10 * i, "FFMA", inner, None) for i in range(4)]  # unrolled x4
    code += [ins(0x50, "BRA", inner, ".L_x_1")]
    code += [ins(0x60, "FFMA", inner, None), ins(0x70, "BRA", inner, ".L_x_2")]
    code += [ins(0x80, "BRA", outer, ".L_x_0"), ins(0x90, "EXIT", None, None)]
    labels = {".L_x_0": 0x00, ".L_x_1": 0x10, ".L_x_2": 0x60}
    found = static.loops(code, labels, {"J": 25, "BJ": 16, "d": 10})
    assert sorted(loop.trips for loop in found) == [2, 2, 2]
    counts = static.weighted_counts(code, found)
    assert counts["fma"] == 2 * (4 * 2 + 2)


def test_products_of_every_tensor_core_kind_count_as_products():
    """sm_80's HMMA and sm_90's warpgroup HGMMA are both tensor-core products: either makes
    the FLOP bound use the tensor-core peak."""
    ins = static.Instruction
    code = [ins(0x00, "HMMA.1688.F32.TF32", None, None),
            ins(0x10, "HGMMA.64x32x8.F32.TF32", None, None),
            ins(0x20, "FFMA", None, None)]  # fmt: skip
    counts = static.weighted_counts(code, [])
    assert counts["mma"] == 2 and counts["fma"] == 1


def test_a_loop_named_in_another_file_is_read_in_the_kernels_source(tmp_path: Path):
    """Triton's line information can name the file of an inlined helper but the loop's own
    line: that line of the kernel's source gives the trip count; without it the loop counts
    as unknown and runs once."""
    kernel, helper = tmp_path / "kernel.py", tmp_path / "helper.py"
    kernel.write_text("x = 0\nfor r in range(T):\n    x += 1\n")
    helper.write_text("def f():\n    return 1\n")
    ins = static.Instruction
    code = [ins(0x00, "FFMA", (str(kernel), 3), None),
            ins(0x10, "BRA", (str(helper), 2), ".L_x_0")]  # fmt: skip
    labels = {".L_x_0": 0x00}
    (found,) = static.loops(code, labels, {"T": 8}, str(kernel))
    assert found.known and found.trips == 8
    (blind,) = static.loops(code, labels, {"T": 8})
    assert not blind.known and blind.trips == 1


SASS = """
        .text.kernel:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
	//## File "/lib/standard.py", line 293 inlined at "/src/kernel.py", line 7
	//## File "/lib/standard.py", line 263 inlined at "/lib/standard.py", line 293
	//## File "/lib/standard.py", line 293 inlined at "/src/kernel.py", line 7
        /*0010*/                   SHFL.BFLY PT, R3, R2, 0x1, 0x1f ;
        /*0020*/                   FADD R2, R2, R3 ;
	//## File "/src/kernel.py", line 3 inlined at "/src/kernel.py", line 9
	//## File "/src/kernel.py", line 9
.L_x_0:
        /*0030*/                   FFMA R4, R4, R5, R6 ;
	//## File "/src/kernel.py", line 8
        /*0040*/              @P0  BRA `(.L_x_0) ;
"""


def test_each_instruction_keeps_the_lines_it_was_inlined_through():
    """``nvdisasm -gi``: a group of line comments, innermost call first, before a run of
    instructions; the innermost line is the instruction's line, as ``-g`` gives it."""
    code, labels = static.parse_sass(SASS)
    assert [i.opcode for i in code] == ["MOV", "SHFL.BFLY", "FADD", "FFMA", "BRA"]
    assert code[0].line is None and code[0].chain == ()
    assert code[1].line == ("/lib/standard.py", 293)
    assert code[2].chain == (("/lib/standard.py", 293), ("/src/kernel.py", 7),
                             ("/lib/standard.py", 263))  # fmt: skip
    assert code[3].chain == (("/src/kernel.py", 3), ("/src/kernel.py", 9))
    assert code[4].line == ("/src/kernel.py", 8) and code[4].target == ".L_x_0"
    assert labels == {".L_x_0": 0x30}


def test_instructions_count_at_the_innermost_line_of_the_kernels_source(tmp_path: Path):
    """A reduction of Triton's library counts at the line that calls it, a helper's body at
    its own line; the loop's instructions by its trip count; line 0 holds what has none."""
    code, labels = static.parse_sass(SASS)
    found = static.loops(code, labels, {"T": 5})
    found[0].trips = 5  # (no source to read the trip count from)
    counts = static.counts_by_line(code, found, "/src/kernel.py")
    assert counts == {0: 1.0, 7: 2.0, 3: 5.0, 8: 5.0}
    gpu = static.GPUS[90]
    lines = static.top_lines([("forward", "/src/kernel.py", counts),
                              ("forward", "/src/kernel.py", {7: 2.0}),
                              ("backward", "/src/kernel.py", {3: 1.0})], gpu, 2)  # fmt: skip
    assert [(r["kernel"], r["line"]) for r in lines] == [("forward", 3), ("forward", 8),
                                                         ("backward", 3)]  # fmt: skip
    assert lines[0]["share"] == pytest.approx(5 / 15) and lines[2]["share"] == 1.0
    rate = gpu.sms * gpu.schedulers * gpu.clock_ghz * 1e6
    assert lines[0]["issue_ms"] == pytest.approx(5 / rate)
    assert lines[0]["file"] == "kernel.py"


def test_warp_bases_of_each_layout_kind():
    """Per bit of the warp index, the element offset it adds: blocked and MMA layouts step a
    warp's coverage per bit along their axes, linear ones list it, a slice drops its axis."""
    aliases = {
        "#b": "#ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [2, 16], "
              "warpsPerCTA = [4, 1], order = [1, 0]}>",
        "#l": "#ttg.linear<{register = [[0, 1]], lane = [[1, 0]], warp = [[0, 0], [0, 2]], "
              "block = []}>",
        "#m": "#ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [1, 4], "
              "instrShape = [16, 8]}>",
    }  # fmt: skip
    assert static.warp_bases("#b", aliases) == [[2, 0], [4, 0]]
    assert static.warp_bases("#l", aliases) == [[0, 0], [0, 2]]
    assert static.warp_bases("#m", aliases) == [[0, 8], [0, 16]]
    assert static.warp_bases("#ttg.slice<{dim = 0, parent = #b}>", aliases) == [[0], [0]]
    nested = "#ttg.slice<{dim = 0, parent = #ttg.slice<{dim = 1, parent = #m}>}>"
    assert static.warp_bases(nested, aliases) == [[], []]
    assert static.warp_bases("#ttg.dot_op<{opIdx = 0, parent = #m}>", aliases) is None


def test_warp_repeat_counts_the_lanes_that_hold_another_warps_elements():
    """Four warps: an exp on a 16 x 64 tensor whose layout spreads the warps over its rows
    (none repeats) and an add on one whose linear layout keeps every warp on the same
    elements (three of four copies repeat), each weighted by its elements."""
    ttgir = "\n".join([
        "#blocked = #ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [1, 32], "
        "warpsPerCTA = [4, 1], order = [1, 0]}>",
        "#linear = #ttg.linear<{register = [[0, 1]], lane = [[1, 0]], warp = [[0, 0], [0, 0]], "
        "block = []}>",
        "  %a = math.exp %x : tensor<16x64xf32, #blocked> loc(#loc1)",
        "  %b = arith.addf %y, %z : tensor<16x64xf32, #linear> loc(#loc2)",
        "  %c = arith.addi %i, %j : tensor<16xi32, #ttg.slice<{dim = 1, parent = #blocked}>>",
    ])  # fmt: skip
    assert static.warp_repeat(ttgir, 4) == pytest.approx(3 * 1024 / (1024 + 4 * 1024))
    # a tensor of 2 rows in the blocked layout: warps 2 and 3 repeat warps 0 and 1
    assert static.warp_repeat(ttgir.replace("16x64", "2x64").split("\n  %b")[0], 4) == 0.5


def test_useful_flops_and_bytes_of_a_layer():
    sizes = dict(Z=1, L=1, Lkv=1, G=2, M=3, d=4, J=5, e=2, D=5, V=2, enc=6, single=False,
                 rows=2, gl_v=False, tables=100)  # fmt: skip
    # content, W and spatial, out: J M G d twice, K J G e, K J G d
    assert static.useful_flops(sizes, "forward") == 2 * (2 * 120 + 2 * 5 * 2 * 2 + 2 * 5 * 2 * 4)
    assert static.useful_flops(sizes, "backward") == 2 * static.useful_flops(sizes, "forward")
    # in: q 8, k and v 24, the group term 6, rho 20 numbers and 100 bytes of tables; out: 8 + 4
    assert static.dram_bytes(sizes, "forward", 4) == (8 + 24 + 6 + 20) * 4 + 100 + 12 * 4
    # and the gradients of the inputs
    assert static.dram_bytes(sizes, "backward", 4) == 380 + (8 + 24 + 6 + 20) * 4


def _z2_report(workdir: Path, *options: str):
    """``preset=gpu-static`` for the z2 net at batch 1 with ``options``, run into
    ``workdir / "run"``; skips where Triton cannot compile for NVIDIA GPUs."""
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")
    return run_symattn("benchmark", "preset=gpu-static", "groups=[z2]", "batch_sizes=[1]",
                       *options, "logger.mode=disabled", f"hydra.run.dir={workdir / 'run'}",
                       cwd=workdir)  # fmt: skip


@pytest.mark.slow
def test_gpu_static_preset_reports_every_launch_of_a_net(workdir: Path):
    """The z2 net at batch 1: the lifting and four group layers, forward and backward each,
    by both Triton kernels, compiled for sm_90, with the totals; a row per launch in the run
    file; the issue bounds side by side."""
    out = workdir / "run"
    result = _z2_report(workdir, "attention_backends=[triton,triton_tiles]")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "H100" in result.stdout and "estimates" in result.stdout
    rows = read_table(out / "run.h5", "static")
    assert "issue bound, triton over triton_tiles" in result.stdout
    layers = rows["layer"] != "total"
    assert set(rows["kernel"][layers]) == {"forward", "backward"}
    assert set(rows["attention_backend"]) == {"triton", "triton_tiles"}
    assert layers.sum() == 2 * 2 * 6 and (~layers).sum() == 2 * 3  # six attention layers
    for column in ("regs", "programs", "instructions_per_program", "issue_ms", "flop_ms",
                   "dram_ms"):  # fmt: skip
        assert np.all(rows[column][layers] > 0), column
    assert np.all((rows["occupancy"] > 0) & (rows["occupancy"] <= 1))
    summary = read_summary(out / "run.h5")
    assert summary["arch"] == 90 and summary["case0_fwd_bwd_issue_ms"] > 0
    assert summary["case0_triton_tiles_fwd_bwd_issue_ms"] > 0


@pytest.mark.slow
def test_gpu_static_preset_names_the_costliest_lines_under_a_register_cap(workdir: Path):
    """``lines=3``: each kernel's three source lines with the most instructions, printed and
    in the run file; ``max_registers=64``: every launch compiled within 64 registers."""
    out = workdir / "run"
    result = _z2_report(workdir, "attention_backends=[triton_tiles]", "lines=3",
                        "max_registers=64")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the source lines with the most instructions" in result.stdout
    rows = read_table(out / "run.h5", "static")
    assert np.all(rows["regs"] <= 64)
    lines = read_table(out / "run.h5", "static_lines")
    assert list(lines["kernel"]) == ["forward"] * 3 + ["backward"] * 3
    assert set(lines["file"]) == {"triton_tiles_kernel.py"}
    for kernel in ("forward", "backward"):
        share = lines["share"][lines["kernel"] == kernel]
        assert np.all(np.diff(share) <= 0) and 0 < share.sum() <= 1
    source = Path(static.__file__).parents[1] / "nn" / "gsa" / "triton_tiles_kernel.py"
    text = source.read_text().splitlines()
    assert all(text[int(n) - 1].strip() == t
               for n, t in zip(lines["line"], lines["text"], strict=True) if n)  # fmt: skip


@pytest.mark.slow  # the command in a subprocess: gpu-static imports Triton compiled
def test_a_register_cap_beyond_a_thread_or_a_negative_line_count_is_a_clear_error(
    workdir: Path,
):
    with pytest.raises(ConfigError, match="max_registers=300: a thread has at most 255"):
        static.report(None, max_registers=300)
    result = run_symattn("benchmark", "preset=gpu-static", "lines=-1", "logger.mode=disabled",
                         f"hydra.run.dir={workdir / 'run'}", cwd=workdir)  # fmt: skip
    assert result.returncode != 0
    assert "lines=-1: give how many source lines" in result.stderr


@pytest.mark.slow
def test_a_register_cap_too_small_for_a_kernel_names_the_least_it_needs(workdir: Path):
    result = _z2_report(workdir, "attention_backends=[triton_tiles]", "max_registers=16")
    assert result.returncode != 0
    assert re.search(r"max_registers=16 is too few for the 1 lifting .* forward kernel: the "
                     r"assembler needs at least \d+; raise the cap", result.stderr)  # fmt: skip


def test_baseline_launchers_bring_their_own_kernels(tmp_path: Path):
    """The Triton backends at a git revision: each launcher's kernels come from that
    revision's copy of its kernel file, not from today's module, and its launches use them."""
    from ..nn.test_gsa_core import _inputs

    loaded = static.baseline_launchers("HEAD", tmp_path)
    assert set(loaded) == set(static.KERNELS)
    for backend, launcher in loaded.items():
        kernels = launcher.kernels()
        assert Path(kernels.__file__) == tmp_path / f"baseline_{backend}_kernel.py"
        assert kernels is not importlib.import_module(f"symattn_cli.nn.gsa.{backend}").kernels()
    q, k, v, grho, rho, offsets, nb, valid, n = _inputs(z=1, n_q=3, by_v=True)
    call = static.Call("layer", q, k, v, grho, rho, offsets, nb, valid, "sum", n, 0.1)
    for launch in static.launches(call, "triton_tiles", launcher=loaded["triton_tiles"]):
        assert launch.fn is getattr(loaded["triton_tiles"].kernels(), launch.fn.__name__)


def test_baseline_revision_that_does_not_exist_is_a_clear_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="kernel_baseline='no-such-rev'.*HEAD~1"):
        static.baseline_launchers("no-such-rev", tmp_path)


@pytest.mark.slow
def test_gpu_static_preset_sets_another_revision_beside_todays(workdir: Path):
    """``kernel_baseline=HEAD``: each launch of the tiled kernel compiled at that revision and
    today's, both tables and the ratio of their issue bounds, rows of both in the run file."""
    out = workdir / "run"
    result = _z2_report(workdir, "attention_backends=[triton_tiles]", "kernel_baseline=HEAD")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "issue bound, triton_tiles@HEAD over today's triton_tiles" in result.stdout
    rows = read_table(out / "run.h5", "static")
    assert set(rows["attention_backend"]) == {"triton_tiles", "triton_tiles@HEAD"}
    assert read_summary(out / "run.h5")["case0_baseline_fwd_bwd_issue_ms"] > 0


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_static_preset_times_each_launch_on_a_gpu(workdir: Path):
    """With ``device=cuda`` every launch also runs on the GPU: a positive median time per
    launch, summed in the totals, beside the bounds."""
    major, minor = torch.cuda.get_device_capability()
    out = workdir / "run"
    result = run_symattn(
        "benchmark", "preset=gpu-static", "groups=[z2]", "batch_sizes=[1]", "device=cuda",
        f"arch={major}{minor}", "logger.mode=disabled", f"hydra.run.dir={out}", cwd=workdir,
    )  # fmt: skip
    if result.returncode != 0 and "no peak figures" in result.stderr:
        pytest.skip(f"no peak figures for sm_{major}{minor}")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_table(out / "run.h5", "static")
    layers = rows["layer"] != "total"
    assert np.all(rows["measured_ms"] > 0) and np.all(rows["measured_over_issue"] > 0)
    fwd_bwd = rows["kernel"] == "fwd+bwd"
    assert np.isclose(rows["measured_ms"][fwd_bwd][0], rows["measured_ms"][layers].sum())
    assert read_summary(out / "run.h5")["case0_fwd_bwd_measured_ms"] > 0


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_static_preset_times_another_revision_beside_todays(workdir: Path):
    """With ``device=cuda`` and ``kernel_baseline=HEAD`` both versions' launches are timed and
    the measured ratio printed."""
    major, minor = torch.cuda.get_device_capability()
    out = workdir / "run"
    result = run_symattn(
        "benchmark", "preset=gpu-static", "groups=[z2]", "batch_sizes=[1]", "device=cuda",
        f"arch={major}{minor}", "attention_backends=[triton_tiles]", "kernel_baseline=HEAD",
        "logger.mode=disabled", f"hydra.run.dir={out}", cwd=workdir,
    )  # fmt: skip
    if result.returncode != 0 and "no peak figures" in result.stderr:
        pytest.skip(f"no peak figures for sm_{major}{minor}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "measured, triton_tiles@HEAD over today's triton_tiles" in result.stdout
    assert read_summary(out / "run.h5")["case0_baseline_fwd_bwd_measured_ms"] > 0
