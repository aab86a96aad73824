"""Time and peak memory of one GSA-Net training step (forward + backward), fp32 on CPU.

Measures the rotMNIST architecture of GSA-Nets (5x5 local attention, 20 channels, 9 heads,
blocks [2, 3]) the way the reference implementation's cost was measured: median wall time of
a forward + backward over ``repeats`` after ``warmup`` steps, and peak resident-memory growth
of a fresh process (peak RSS minus RSS just before the first step).

    python -m symattn_cli.bench.gsa_speed --group r8 --batch 2 --threads 2

Returns/prints numbers; the reference figures (2-core CPU) are in :data:`REFERENCE`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

# Reference implementation, rotMNIST model, 5x5, fp32, forward + backward, 2-core CPU.
REFERENCE = {  # (group, batch) -> (seconds, peak RSS growth in GB)
    ("z2", 2): (0.4, 0.16),
    ("r4", 2): (3.4, 0.84),
    ("r8", 2): (14.0, 4.31),
}


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmRSS line (Linux only)")


def measure_step(
    *,
    group: str = "r8",
    batch: int = 2,
    image_size: int = 28,
    patch_size: int = 5,
    query_form: str = "sum",
    checkpointing: bool = True,
    naive: bool = False,
    chunk_elements: int = 1 << 18,
    repeats: int = 5,
    warmup: int = 1,
    threads: int = 2,
    seed: int = 0,
) -> dict:
    """Run in this process: median step time (s) and peak RSS growth (bytes)."""
    import torch

    from symattn_cli.data.base import DataSpec
    from symattn_cli.models.gsa_net import build

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    spec = DataSpec(task="classify", num_classes=10, in_channels=1, image_size=image_size,
                    arch="rotmnist")  # fmt: skip
    model = build(
        {"group": group, "patch_size": patch_size, "query_form": query_form,
         "checkpointing": checkpointing, "chunk_elements": chunk_elements,
         # naive: the reference's algorithm (full N^3 P^2 logits, (m - g + v) index)
         "group_index": "shifted" if naive else "relative"},
        spec,
    ).train()  # fmt: skip
    x = torch.randn(batch, 1, image_size, image_size)
    y = torch.randint(0, 10, (batch,))
    base = _rss_bytes()
    times = []
    for step in range(warmup + repeats):
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "group": group,
        "batch": batch,
        "query_form": query_form,
        "checkpointing": checkpointing,
        "naive": naive,
        "chunk_elements": chunk_elements,
        "threads": threads,
        "time_s": statistics.median(times),
        "times_s": times,
        "peak_rss_growth_gb": max(peak - base, 0) / 1e9,
        "params": sum(p.numel() for p in model.parameters()),
    }


def measure_fresh(**kwargs) -> dict:
    """:func:`measure_step` in a fresh Python process (clean peak-RSS accounting)."""
    code = (
        "import json, sys; from symattn_cli.bench.gsa_speed import measure_step; "
        f"print(json.dumps(measure_step(**{kwargs!r})))"
    )
    # Passive OpenMP waiting: on a shared machine spinning threads would measure contention.
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark subprocess failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(groups=("r4", "r8"), batch: int = 2, **kwargs) -> list[dict]:
    """Measure each group in a fresh process and add the ratios to the reference figures."""
    rows = []
    for group in groups:
        row = measure_fresh(group=group, batch=batch, **kwargs)
        ref = REFERENCE.get((group, batch))
        if ref is not None:
            row["ref_time_s"], row["ref_peak_gb"] = ref
            row["speedup"] = ref[0] / row["time_s"]
            row["memory_ratio"] = ref[1] / max(row["peak_rss_growth_gb"], 1e-9)
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'group':6} {'batch':>5} {'form':>6} {'time s':>8} {'peak GB':>8} "
    head += f"{'ref s':>7} {'ref GB':>7} {'speedup':>8} {'mem ratio':>9}"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['group']:6} {r['batch']:5d} {r['query_form']:>6} {r['time_s']:8.3f} "
            f"{r['peak_rss_growth_gb']:8.3f} {r.get('ref_time_s', float('nan')):7.1f} "
            f"{r.get('ref_peak_gb', float('nan')):7.2f} {r.get('speedup', float('nan')):8.1f} "
            f"{r.get('memory_ratio', float('nan')):9.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", nargs="+", default=["r4", "r8"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--query-form", default="sum", choices=["sum", "single"])
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--naive", action="store_true", help="reference algorithm (N^3 logits)")
    parser.add_argument("--chunk-elements", type=int, default=1 << 18)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    rows = compare(
        groups=args.group, batch=args.batch, query_form=args.query_form,
        checkpointing=not args.no_checkpointing, naive=args.naive,
        chunk_elements=args.chunk_elements, repeats=args.repeats, warmup=args.warmup,
        threads=args.threads,
    )  # fmt: skip
    print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    return rows


if __name__ == "__main__":
    main()
