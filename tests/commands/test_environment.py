"""What every run file records about the host."""

from __future__ import annotations

from pathlib import Path

from symattn_cli.commands.common import cpu_name, device_name, environment

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse sse2 avx fma avx2 avx512f avx512bw
processor\t: 1
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse sse2 avx fma avx2 avx512f avx512bw
"""


def test_the_cpu_is_named_with_its_widest_vector_instructions(tmp_path: Path):
    """The C++ kernel's tiles are one vector register wide, so a CPU's timings are only
    comparable with its vector width named."""
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO)
    assert cpu_name(info) == "AMD EPYC 9B14, AVX-512"
    info.write_text(CPUINFO.replace(" avx512f avx512bw", ""))
    assert cpu_name(info) == "AMD EPYC 9B14, AVX2"
    info.write_text(CPUINFO.replace(" avx2 avx512f avx512bw", ""))
    assert cpu_name(info) == "AMD EPYC 9B14"
    assert cpu_name(tmp_path / "absent")  # the machine's name instead


def test_a_cpu_runs_record_the_cpus_name():
    assert environment("cpu")["device_name"] == device_name("cpu") == cpu_name()
