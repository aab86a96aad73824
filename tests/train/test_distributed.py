"""Data-parallel helpers: the process group's backends and the reduction of epoch totals."""

from __future__ import annotations

import torch.distributed as dist

from symattn_cli.train.distributed import World, process_group_backend, sum_across


def _backends(spec: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}``; a bare name serves both."""
    if ":" not in spec:
        return {"cpu": spec, "cuda": spec}
    return dict(part.split(":") for part in spec.split(","))


def test_gpu_runs_reduce_host_tensors_through_gloo():
    """NCCL reduces CUDA tensors only, and the epoch totals are host tensors: with GPUs the
    group needs gloo for the CPU beside NCCL for the gradients."""
    assert _backends(process_group_backend(use_cuda=True)) == {"cpu": "gloo", "cuda": "nccl"}
    assert _backends(process_group_backend(use_cuda=False))["cpu"] == "gloo"


def test_epoch_totals_are_summed_through_the_host_backend(tmp_path):
    """sum_across on a real process group started from the GPU spec's CPU half (NCCL itself
    needs a GPU); one process, so the sum is the process's own totals."""
    cpu_half = f"cpu:{_backends(process_group_backend(use_cuda=True))['cpu']}"
    dist.init_process_group(cpu_half, init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        totals = {"loss": 3.5, "correct": 7.0, "count": 10.0}
        assert sum_across(World(rank=0, size=2), totals) == totals
    finally:
        dist.destroy_process_group()
