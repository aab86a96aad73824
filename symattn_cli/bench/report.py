"""Rich tables of benchmark results: every case, the reference comparison, the fits."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def number(value: Any, spec: str) -> str:
    """``value`` formatted with ``spec``; ``-`` for a missing or NaN value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _flops(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.0f}"


def cases_table(rows: Sequence[dict[str, Any]], modes: Sequence[str]):
    from rich.table import Table

    table = Table(title="benchmark cases (median s ± IQR, peak memory growth MB)")
    table.add_column("case", no_wrap=True)
    table.add_column("params", justify="right")
    for mode in modes:
        short = {"train": "fwd+bwd", "forward": "fwd", "step": "step"}[mode]
        for name in ("s", "cpu s", "img/s", "MB", "FLOPs", "%GEMM"):
            table.add_column(f"{short} {name}", justify="right", no_wrap=True)
    for row in rows:
        cells = [row["label"], number(row.get("params"), ",.0f")]
        if row.get("status") != "ok":
            cells += [f"[red]{row.get('status')}[/red]"] + ["-"] * (6 * len(modes) - 1)
            table.add_row(*cells)
            continue
        for mode in modes:
            time_s, iqr = row.get(f"{mode}_time_s"), row.get(f"{mode}_time_iqr_s")
            fraction = row.get(f"{mode}_flop_fraction")
            cells += [
                f"{number(time_s, '.4f')} ± {number(iqr, '.4f')}",
                number(row.get(f"{mode}_cpu_s"), ".4f"),
                number(row.get(f"{mode}_items_per_s"), ".4g"),
                number(row.get(f"{mode}_mem_mb"), ".1f"),
                _flops(row.get(f"{mode}_flops")),
                number(None if fraction is None else 100 * fraction, ".2f"),
            ]
        table.add_row(*cells)
    return table


def reference_table(rows: Sequence[dict[str, Any]]):
    from rich.table import Table

    table = Table(
        title="ours vs the reference implementation (rotMNIST net, batch 2, fp32, fwd+bwd)"
    )
    for name in ("model", "ours s", "ref s", "time ratio", "ours GB", "ref GB", "memory ratio",
                 "≥10× both", "ref figures"):  # fmt: skip
        table.add_column(name, justify="left" if name in ("model", "ref figures") else "right")
    for row in rows:
        if "time_ratio" not in row:
            continue
        table.add_row(
            row["label"],
            number(row["train_time_s"], ".3f"),
            number(row["ref_time_s"], ".2f"),
            f"{row['time_ratio']:.1f}×",
            number(row["train_mem_mb"] / 1e3, ".4f"),
            number(row["ref_mem_gb"], ".3f"),
            f"{row['mem_ratio']:.1f}×",
            "yes" if row["meets_target"] else "[red]no[/red]",
            row["ref_source"],  # measured in this run, or published
        )
    return table


def fits_table(fits: Sequence[dict[str, Any]]):
    from rich.table import Table

    table = Table(title="growth exponents k: quantity ~ x^k (log-log least squares)")
    for name in ("quantity", "axis", "series", "held fixed", "x range", "k", "r²"):
        table.add_column(name, justify="right" if name in ("k", "r²") else "left")
    for fit in fits:
        table.add_row(
            fit["quantity"],
            fit["axis"],
            fit["series"],
            fit["fixed"],
            f"{fit['x_min']:g}–{fit['x_max']:g} ({fit['points']})",
            f"{fit['exponent']:.2f}",
            f"{fit['r2']:.3f}",
        )
    return table


def naive_line(ratios: dict[str, float]) -> str:
    """One line per group: how much the reference's algorithm costs over ours, same run."""
    return ratio_lines(ratios, "naive", "reference algorithm (sum-naive) / ours (sum)")


def index_lines(ratios: dict[str, float]) -> str:
    """One line per group and v-dependent group index: its cost over ``relative``, same run."""
    lines = []
    for index in ("pair", "gevit"):
        picked = {k: v for k, v in ratios.items() if f"_{index}_" in k}
        if picked:
            lines.append(ratio_lines(picked, index, f"sum+{index} / sum+relative"))
    return "\n".join(lines)


def ratio_lines(ratios: dict[str, float], name: str, title: str) -> str:
    """``<group>_<name>_<mode>_<time|mem>_ratio`` entries as one line per group."""
    groups = sorted({key.split(f"_{name}_")[0] for key in ratios})
    lines = []
    for group in groups:
        parts = []
        for mode in ("train", "forward"):
            time_key, mem_key = (
                f"{group}_{name}_{mode}_time_ratio",
                f"{group}_{name}_{mode}_mem_ratio",
            )
            if time_key in ratios:
                parts.append(
                    f"{'fwd+bwd' if mode == 'train' else 'fwd'} {ratios[time_key]:.2f}x time, "
                    f"{ratios[mem_key]:.2f}x memory"
                )
        lines.append(f"{title}, {group} layer: " + "; ".join(parts))
    return "\n".join(lines)


def static_table(rows: Sequence[dict[str, Any]], title: str):
    """The static GPU report: one row per kernel launch, then the totals."""
    from rich.table import Table

    table = Table(title=title)
    measured = "measured_ms" in rows[0]
    timed = ("measured ms", "/issue", "/bound") if measured else ()
    for name in ("layer", "kernel", "programs", "regs", "spills", "smem KiB", "occ %",
                 "waves", "warp rep %", "k instr/prog", "atomics/prog", "issue ms", "FLOP ms",
                 "DRAM ms", "issue/bound", *timed):  # fmt: skip
        table.add_column(name, justify="left" if name in ("layer", "kernel") else "right",
                         no_wrap=True)  # fmt: skip
    for row in rows:
        total = row["layer"] == "total"
        spills = f"{row['stack_bytes']} B/{row['spill_instructions']}"
        table.add_row(
            row["layer"], row["kernel"], number(row["programs"], ",.0f"),
            number(row["regs"], "d"), spills, number(row["shared_bytes"] / 1024, ".1f"),
            number(100 * row["occupancy"], ".0f"), "" if total else number(row["waves"], ".1f"),
            number(100 * row["warp_repeat"], ".0f"),
            "" if total else number(row["instructions_per_program"] / 1e3, ".1f"),
            "" if total else number(row["atomics_per_program"], ",.0f"),
            number(row["issue_ms"], ".3f"), number(row["flop_ms"], ".3f") + f" {row['flop_unit']}",
            number(row["dram_ms"], ".3f"), number(row["issue_over_bound"], ".1f"),
            *((number(row["measured_ms"], ".3f"), number(row["measured_over_issue"], ".2f"),
               number(row["measured_over_bound"], ".1f")) if measured else ()),
            style="bold" if total else None,
        )  # fmt: skip
    return table


def static_lines_table(rows: Sequence[dict[str, Any]], title: str):
    """The source lines of each kernel with the most warp instructions
    (:func:`symattn_cli.bench.static.top_lines`)."""
    from rich.table import Table

    table = Table(title=title)
    for name in ("kernel", "line", "source", "share %", "issue ms"):
        table.add_column(name, justify="right" if name in ("line", "share %", "issue ms")
                         else "left", no_wrap=name != "source")  # fmt: skip
    for row in rows:
        table.add_row(row["kernel"], f"{row['file']}:{row['line']}" if row["line"] else "",
                      row["text"], number(100 * row["share"], ".1f"),
                      number(row["issue_ms"], ".3f"))  # fmt: skip
    return table


STEP_PARTS = (  # the parts of a training step, as symattn_cli.train.profile names them
    "attention kernel forward", "attention kernel backward", "1x1 projections",
    "layout copies", "norms and activations", "other step operators", "optimizer",
)  # fmt: skip


def step_table(rows: Sequence[dict[str, Any]], baseline: str):
    """The training step of each case (median ms) as a ratio over ``baseline``'s (a row's
    ``name`` without overrides), and where its time goes, ms per part (from a profile)."""
    from rich.table import Table

    base = next((r for r in rows if r.get("name") == baseline and r.get("status") == "ok"
                 and "step_time_s" in r and "=" not in r["label"]), None)  # fmt: skip
    table = Table(title=f"training step (forward, backward, Adam): median ms, ratio over "
                        f"{baseline}, and ms per part (profiled)")  # fmt: skip
    for column in ("case", "params", "ms", f"/ {baseline}", *STEP_PARTS):
        table.add_column(column, justify="left" if column == "case" else "right")
    for row in rows:
        if row.get("status") != "ok" or "step_time_s" not in row:
            continue
        ratio = row["step_time_s"] / base["step_time_s"] if base else None
        parts = [number(1e3 * row.get(f"step_part_{p.replace(' ', '_')}_s", 0.0), ".1f")
                 for p in STEP_PARTS]  # fmt: skip
        table.add_row(
            row["label"],
            number(row.get("params"), ",.0f"),
            number(1e3 * row["step_time_s"], ".1f"),
            number(ratio, ".2f"),
            *parts,
        )
    return table
