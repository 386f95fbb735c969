"""Collectives as free functions over torch.distributed; world size 1 needs no process group.

gloo has no reduce-scatter, so there a gradient is all-reduced and each rank keeps its slice;
NCCL uses `reduce_scatter_tensor`. Both give every rank the sum over ranks of its shard.

A process group made here waits at most `Config.collective_timeout` seconds in any collective.
A rank that stalls (or dies) then turns into `RanksLostError` on the others, naming the
collective and what to do, where gloo alone would wait 30 minutes and then say little. A gloo
group is destroyed as that error is raised, so that the process can exit cleanly.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# What gloo and NCCL say when a peer is late or gone (their errors are plain RuntimeErrors).
_LOST = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "remote worker crashing")


class RanksLostError(RuntimeError):
    """A collective gave up on the other ranks: one of them is stalled or has died."""


@dataclass(frozen=True, slots=True)
class Group:
    """This process's place among the ranks; `world == 1` means no process group at all."""

    rank: int = 0
    world: int = 1
    timeout: float | None = None  # seconds a collective waits; None: the process group's own

    @property
    def backend(self) -> str | None:
        return dist.get_backend() if self.world > 1 else None


def rank_device(device: str | torch.device | None) -> torch.device:
    """The device given, else this rank's GPU (torchrun's LOCAL_RANK) where CUDA exists, else the CPU."""
    out = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if out.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "it sees no GPU"
            raise ValueError(f"device={str(device)!r}, but {why}; pass device='cpu', or leave it None to take "
                             "the GPU where there is one.")
        if out.index is None:
            out = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if out.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(out)!r}: this machine shows {torch.cuda.device_count()} GPU(s) "
                             "(CUDA_VISIBLE_DEVICES included); name one of them, or launch one rank per GPU.")
        torch.cuda.set_device(out)  # NCCL and object collectives use the current device
    return out


def init_group(device: torch.device, timeout: float) -> Group:
    """Join the default process group from torchrun's environment, or run as one rank. A group the
    caller made already is joined with its own timeout."""
    if dist.is_available() and dist.is_initialized():
        return Group(dist.get_rank(), dist.get_world_size())
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        joining = Group(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), timeout)
        with _guarded("joining the process group", joining):
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout))
        return Group(dist.get_rank(), dist.get_world_size(), timeout)
    return Group()


@contextlib.contextmanager
def _guarded(what: str, group: Group) -> Iterator[None]:
    try:
        yield
    except RuntimeError as e:
        if not any(word in str(e).lower() for word in _LOST):
            raise
        waited = f"more than {group.timeout:.0f} s" if group.timeout else "past the process group's timeout"
        give_up_group()
        raise RanksLostError(
            f"rank {group.rank}: {what} waited {waited} for the other ranks, or one of them went away: a rank is "
            f"stalled or dead; see its log. If a step of this model legitimately takes longer, raise "
            f"Config.collective_timeout (outcore train --timeout). ({str(e).splitlines()[0][:200]})") from e


def give_up_group() -> None:
    """After a gloo collective gave up, or a backward pass failed partway on this rank (the ranks'
    collectives then out of step), the group is of no further use; destroyed, it tells the others at
    once, and left alive it made the process abort on its way out (std::terminate from gloo's
    threads, 3 runs in 8 here): destroy it now. NCCL's watchdog ends the process itself."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def barrier(group: Group) -> None:
    if group.world > 1:
        with _guarded("a barrier", group):
            dist.barrier()


def gather_objects(value: Any, group: Group) -> list[Any]:
    """Every rank's `value`, in rank order (small picklable records only)."""
    if group.world == 1:
        return [value]
    out: list[Any] = [None] * group.world
    with _guarded("all_gather_object", group):
        dist.all_gather_object(out, value)
    return out


def all_gather_chunk(full: torch.Tensor, piece: torch.Tensor, shard: int, start: int, end: int,
                     group: Group) -> None:
    """Fill elements [start, end) of every rank's shard inside `full` from each rank's `piece`."""
    if group.world == 1:
        full[start:end].copy_(piece)
        return
    with _guarded("all_gather", group):
        dist.all_gather([full[r * shard + start : r * shard + end] for r in range(group.world)], piece)


def reduce_scatter(full: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's shard of the sum of `full` over ranks (`full` may be overwritten)."""
    if group.world == 1:
        return full
    if group.backend == "nccl":
        out = torch.empty(full.numel() // group.world, dtype=full.dtype, device=full.device)
        with _guarded("reduce_scatter", group):
            dist.reduce_scatter_tensor(out, full)
        return out
    with _guarded("reduce_scatter (all_reduce on gloo)", group):
        dist.all_reduce(full)
    return full.chunk(group.world)[group.rank]


def all_reduce_sum(value: torch.Tensor, group: Group) -> torch.Tensor:
    if group.world > 1:
        with _guarded("all_reduce", group):
            dist.all_reduce(value)
    return value
