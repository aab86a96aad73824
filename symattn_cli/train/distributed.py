"""Data-parallel training under ``torchrun``: process group, sampler, reductions.

``torchrun --nproc_per_node=K -m symattn_cli train ...`` starts K processes with ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE`` set; each trains on its shard of every epoch and DDP averages
the gradients. Only rank 0 writes the run file and streams to W&B. Without those variables
everything here is a no-op and training runs in one process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    local_rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init_world(device: str = "auto") -> World:
    """Join the process group ``torchrun`` describes in the environment (or stay alone)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device != "cpu" and torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group(backend=process_group_backend(use_cuda))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    return World(rank=rank, local_rank=local_rank, size=size)


def process_group_backend(use_cuda: bool) -> str:
    """The process group's backend per device type: NCCL for the gradients of a model on GPUs,
    and gloo for host tensors in both cases. NCCL reduces CUDA tensors only, and the epoch
    totals of :func:`sum_across` are host tensors."""
    return "cpu:gloo,cuda:nccl" if use_cuda else "gloo"


def device_for(world: World, device: str) -> str:
    """Each process's device: ``cuda:<local rank>`` under torchrun with GPUs."""
    if world.distributed and device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{world.local_rank}"
    return device


def sum_across(world: World, totals: Mapping[str, float]) -> dict[str, float]:
    """Sum per-process totals (losses, counts) over all processes."""
    if not world.distributed or not totals:
        return dict(totals)
    keys = sorted(totals)
    values = torch.tensor([float(totals[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(values)
    return dict(zip(keys, values.tolist(), strict=True))


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def shutdown(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
