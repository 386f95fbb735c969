"""Collectives as free functions over torch.distributed; world size 1 needs no process group.

gloo has no reduce-scatter, so there a gradient is all-reduced and each rank keeps its slice;
NCCL uses `reduce_scatter_tensor`. Both give every rank the sum over ranks of its shard.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Group:
    """This process's place among the ranks; `world == 1` means no process group at all."""

    rank: int = 0
    world: int = 1

    @property
    def backend(self) -> str | None:
        return dist.get_backend() if self.world > 1 else None


def init_group(device: torch.device) -> Group:
    """Join the default process group from torchrun's environment, or run as one rank."""
    if dist.is_available() and dist.is_initialized():
        return Group(dist.get_rank(), dist.get_world_size())
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return Group(dist.get_rank(), dist.get_world_size())
    return Group()


def all_gather_chunk(full: torch.Tensor, piece: torch.Tensor, shard: int, start: int, end: int,
                     group: Group) -> None:
    """Fill elements [start, end) of every rank's shard inside `full` from each rank's `piece`."""
    if group.world == 1:
        full[start:end].copy_(piece)
        return
    dist.all_gather([full[r * shard + start : r * shard + end] for r in range(group.world)], piece)


def reduce_scatter(full: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's shard of the sum of `full` over ranks (`full` may be overwritten)."""
    if group.world == 1:
        return full
    if group.backend == "nccl":
        out = torch.empty(full.numel() // group.world, dtype=full.dtype, device=full.device)
        dist.reduce_scatter_tensor(out, full)
        return out
    dist.all_reduce(full)
    return full.chunk(group.world)[group.rank]


def all_reduce_sum(value: torch.Tensor, group: Group) -> torch.Tensor:
    if group.world > 1:
        dist.all_reduce(value)
    return value
