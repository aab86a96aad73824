"""``reference_code``: the authors' rotMNIST GSA-Nets measured beside ours.

The fast tests run a stand-in for a checkout of github.com/dwromero/g_selfatt: their package
names and their network's keyword arguments in front of a small real network. The slow test
runs their z2 net from a real checkout, given by ``SYMATTN_REFERENCE_CODE``.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from symattn_cli.bench.measure import Case, Settings, authors_net, measure_fresh
from symattn_cli.bench.suite import (
    PRESETS,
    check_reference_code,
    reference_comparison,
    resolve,
    with_authors,
)
from symattn_cli.commands.benchmark import run_cases
from symattn_cli.errors import ConfigError
from symattn_cli.groups import get_group
from symattn_cli.train.runfile import read_table

GROUPS = """
class SE2:
    def __init__(self, num_elements):
        self.num_elements = num_elements


class E2(SE2):
    pass
"""

# Their keyword arguments, no others; one output channel per group element, so the parameter
# count (20 N + 10) says which group it was built on. Warns on import, as theirs does.
MODELS = """
import warnings

import torch

warnings.warn("`torch.cuda.amp.autocast(args...)` is deprecated", FutureWarning)


def GroupTransformer(*, group, in_channels, num_channels, block_sizes, expansion_per_block,
                     crop_per_layer, image_size, num_classes, dropout_rate_after_maxpooling,
                     maxpool_after_last_block, normalize_between_layers, patch_size, num_heads,
                     norm_type, activation_function, attention_dropout_rate, value_dropout_rate,
                     whitening_scale):
    n = group.num_elements
    net = torch.nn.Sequential(torch.nn.Conv2d(in_channels, n, 3), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(n, num_classes))
    net.group = type(group).__name__
    return net
"""

FAST = Settings(repeats=1, warmup=0, threads=1, modes=("train",))


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch) -> Iterator[str]:
    """A stand-in checkout, and a stand-in einops (which their code imports) ahead of any
    installed one, here and in child processes; its modules leave this process with the test."""
    before = set(sys.modules)
    site = tmp_path / "site"
    (site / "einops").mkdir(parents=True)
    (site / "einops" / "__init__.py").write_text("")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    )
    code = tmp_path / "g_selfatt"
    (code / "g_selfatt" / "groups").mkdir(parents=True)
    (code / "g_selfatt" / "__init__.py").write_text("")
    (code / "g_selfatt" / "groups" / "__init__.py").write_text(GROUPS)
    (code / "models").mkdir()
    (code / "models" / "__init__.py").write_text(MODELS)
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    yield str(code)
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("g_selfatt", "models", "einops"):
            del sys.modules[name]


def _reference_z2() -> list[tuple[Case, dict]]:
    return [resolve(c) for c in PRESETS["reference"].cases() if c.group == "z2"]


# ---------------------------------------------------------------- bad input


def test_reference_code_must_be_a_checkout_of_the_authors_code(tmp_path: Path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=re.escape(f"reference_code='{missing}': no such folder")
                       + r".*git clone https://github.com/dwromero/g_selfatt"):  # fmt: skip
        check_reference_code(str(missing))
    (tmp_path / "models").mkdir()
    with pytest.raises(ConfigError, match=r"not a checkout .* \(no g_selfatt/ and models/"):
        check_reference_code(str(tmp_path))


def test_reference_code_needs_einops(stand_in: str, monkeypatch):
    assert check_reference_code(stand_in) == stand_in
    monkeypatch.setitem(sys.modules, "einops", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"reference_code=.* needs einops: pip install einops"):
        check_reference_code(stand_in)


def test_reference_code_needs_a_case_to_compare(stand_in: str):
    quick = [resolve(case) for case in PRESETS["quick"].cases()]
    with pytest.raises(ConfigError, match="no case is a rotMNIST GSA-Net .* preset=reference"):
        with_authors(quick, stand_in)


def test_a_bad_reference_code_is_one_line_and_exit_2(symattn, workdir: Path):
    result = symattn(
        "benchmark", "preset=reference", f"reference_code={workdir}", "logger.mode=disabled",
        f"hydra.run.dir={workdir / 'run'}", cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"reference_code='{workdir}' is not a checkout" in lines[0]
    assert not (workdir / "run" / "run.h5").exists()


# ---------------------------------------------------------------- the authors' nets


def test_authors_net_is_built_on_their_group_for_ours(stand_in: str):
    """Rotations: their SE2 with our group's N elements; with the flip: their E2 with all
    N = 2n. Their import-time warnings are silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, group, order in (("z2", "SE2", 1), ("r8", "SE2", 8), ("r16", "SE2", 16),
                                   ("mirror", "E2", 2), ("r8m", "E2", 16)):  # fmt: skip
            net = authors_net(stand_in, group=get_group(name), image_size=28, patch_size=5)
            params = sum(p.numel() for p in net.parameters())
            assert (net.group, params) == (group, 20 * order + 10), name


def test_authors_net_failing_is_a_runtime_error(tmp_path: Path):
    with pytest.raises(RuntimeError, match="the authors' code in .*: ModuleNotFoundError"):
        authors_net(str(tmp_path), group=get_group("z2"), image_size=28, patch_size=5)


def test_the_ratios_use_the_authors_net_measured_beside_ours(stand_in: str):
    """In process: the authors' z2 net right after ours, timed with the same settings and not
    counted; our row's ratios are its figures over ours."""
    resolved = with_authors(_reference_z2(), stand_in)
    cases, infos = [c for c, _ in resolved], [i for _, i in resolved]
    assert [c.kind for c in cases] == ["model", "authors"]
    assert cases[1].label == "authors z2_sa P5 28px b2" and not cases[1].attends
    ours, theirs = run_cases(cases, infos, FAST, fresh=False, timeout=60)
    assert ours["status"] == theirs["status"] == "ok", (ours["error"], theirs["error"])
    assert theirs["params"] == 30 and theirs["attention_backend"] == ""
    assert theirs["group"] == "z2" and theirs["form"] == "sum"
    assert "train_flops" in ours and "train_flops" not in theirs
    assert "time_ratio" not in theirs
    assert ours["ref_source"] == "measured"
    assert ours["ref_time_s"] == theirs["train_time_s"]
    assert ours["ref_mem_gb"] == pytest.approx(theirs["train_mem_mb"] / 1e3)
    assert ours["time_ratio"] == pytest.approx(theirs["train_time_s"] / ours["train_time_s"])
    assert ours["mem_ratio"] == pytest.approx(
        ours["ref_mem_gb"] / max(ours["train_mem_mb"] / 1e3, 1e-9)
    )


def test_a_failed_authors_net_leaves_the_published_figures(stand_in: str):
    (Path(stand_in) / "models" / "__init__.py").write_text("raise ImportError('broken')\n")
    resolved = with_authors(_reference_z2(), stand_in)
    ours, theirs = run_cases([c for c, _ in resolved], [i for _, i in resolved], FAST,
                             fresh=False, timeout=60)  # fmt: skip
    assert theirs["status"] == "failed" and "broken" in theirs["error"]
    assert ours["status"] == "ok" and ours["ref_source"] == "published"
    assert ours["ref_time_s"] == 0.4


def test_published_figures_only_where_the_issue_has_them():
    _, info = resolve(replace(PRESETS["reference"].cases()[0], group="r12"))
    row = {"train_time_s": 1.0, "train_mem_mb": 100.0}
    assert reference_comparison(info, row) == {}
    measured = reference_comparison(info, row, {"train_time_s": 20.0, "train_mem_mb": 4000.0})
    assert measured["ref_source"] == "measured"
    assert measured["time_ratio"] == pytest.approx(20.0)
    assert measured["mem_ratio"] == pytest.approx(40.0)


@pytest.mark.usefixtures("native_attention_core")
def test_the_command_measures_the_authors_net_in_its_own_process(
    stand_in: str, symattn, workdir: Path
):
    out = workdir / "run"
    result = symattn(
        "benchmark", "preset=reference", "groups=[z2]", f"reference_code={stand_in}",
        "repeats=1", "warmup=0", "count_flops=false", "plot=false", "logger.mode=disabled",
        f"hydra.run.dir={out}", cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"the authors' nets, measured beside ours from their code in {stand_in}" in (
        result.stdout
    )
    assert "ref figures" in result.stdout and "measured" in result.stdout
    cases = read_table(out / "run.h5", "cases")
    assert cases["kind"].tolist() == ["model", "authors"]
    assert cases["status"].tolist() == ["ok", "ok"] and cases["params"][1] == 30
    reference = read_table(out / "run.h5", "reference")
    assert reference["ref_source"].tolist() == ["measured"]
    assert reference["ref_time_s"][0] == cases["train_time_s"][1]


# ---------------------------------------------------------------- their real code


@pytest.mark.slow
@pytest.mark.usefixtures("native_attention_core")
@pytest.mark.skipif(
    not os.environ.get("SYMATTN_REFERENCE_CODE"),
    reason="set SYMATTN_REFERENCE_CODE to a clone of github.com/dwromero/g_selfatt",
)
def test_the_authors_z2_net_from_their_checkout():
    """In a fresh process, as the benchmark runs it (their modules stay out of this one)."""
    code = check_reference_code(os.environ["SYMATTN_REFERENCE_CODE"])
    _, (case, info) = with_authors(_reference_z2(), code)
    assert case.kind == "authors" and info["group"] == "z2"
    row = measure_fresh(case, FAST)
    assert row["params"] == 44368  # their z2 rotMNIST net
    assert row["train_time_s"] > 0 and row["train_mem_mb"] > 0
