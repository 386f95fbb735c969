"""What `outcore estimate` ends with: whether the run fits this machine, and the flags to pass.

The setting is the one `outcore train` would choose (tools/memory_bound.py `choose_offload`: the
least offloading whose states fit in half of the available memory), and its budgets those the
engine derives for it (`MemoryPlan.budgets`). They are checked against what was detected: the RAM
available (on a CPU-only machine both budgets and the step's activations are RAM), a GPU's memory
for the device budget, and the free space of the `--nvme-dir` disk for what rests on NVMe.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from typing import Any

import psutil

from outcore.runtime.sizes import human_bytes
from outcore.tools.activations import Shape, activation_rows, available_memory, chosen_by_train, longest_seq
from outcore.tools.estimate import estimate
from outcore.tools.memory_bound import SLACK, MemoryBound, choose_offload

GPU_SHARE = 0.9  # of a GPU's memory the device budget may take (the CUDA context and allocator keep the rest)


@dataclass(frozen=True)
class Machine:
    ram_total: int
    ram_available: int
    gpu: str | None  # the GPU's name, None without CUDA
    gpu_bytes: int
    nvme_dir: str
    nvme_free: int
    nvme_made_in: str | None = None  # where --nvme-dir would be made, when it does not exist yet

    @classmethod
    def detect(cls, nvme_dir: str) -> Machine:
        import torch

        gpu, gpu_bytes = None, 0
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            gpu, gpu_bytes = props.name, props.total_memory
        where = os.path.abspath(nvme_dir)
        while not os.path.exists(where):  # a folder the run would make: its disk is its parent's
            where = os.path.dirname(where)
        made_in = None if where == os.path.abspath(nvme_dir) else where
        return cls(psutil.virtual_memory().total, available_memory(), gpu, gpu_bytes, nvme_dir,
                   shutil.disk_usage(where).free, made_in)

    def describe(self) -> str:
        gpu = f"GPU {self.gpu} ({human_bytes(self.gpu_bytes)})" if self.gpu else "no GPU"
        return (f"this machine: {human_bytes(self.ram_available)} of {human_bytes(self.ram_total)} RAM available, "
                f"{gpu}, " + (f"{human_bytes(self.nvme_free)} free where --nvme-dir {self.nvme_dir} lies"
                              if self.nvme_made_in is None else
                              f"--nvme-dir {self.nvme_dir} does not exist yet (a run makes it, in {self.nvme_made_in}, "
                              f"where {human_bytes(self.nvme_free)} are free)"))


@dataclass(frozen=True)
class Verdict:
    dtype: str
    stage: int
    offload_params: str
    offload_optimizer: str
    device_budget: int
    host_budget: int
    nvme_bytes: int
    activations: int
    why: str  # why this setting
    short: tuple[str, ...]  # what does not fit, in words; () where it fits
    derived: tuple[int, int] | None = None  # the derived budgets, where they did not fit and these smaller ones do

    @property
    def fits(self) -> bool:
        return not self.short

    def flags(self) -> str:
        """What to pass `outcore train` (sizes rounded up to whole MiB, as --device-budget reads them)."""
        return (f"--dtype {self.dtype} --offload-params {self.offload_params} "
                f"--offload-optimizer {self.offload_optimizer} --device-budget {size_flag(self.device_budget)} "
                f"--host-budget {size_flag(self.host_budget)}")


def size_flag(n: int) -> str:
    return f"{math.ceil(n / (1 << 20))}M"


def verdict(units: list[int], layout: dict, machine: Machine, *, dtype: str, state_dtype: str, world: int,
            prefetch_depth: int, sub_group_size: int, grad_clip: float | None, device: str,
            activations: int) -> Verdict:
    """The setting `outcore train` would take for these units, its derived budgets, and what of it
    does not fit `machine` (see the module's docstring)."""
    params, opt, why = choose_offload(units, dtype, 3, grad_clip, prefetch_depth, MemoryBound.now(None, activations),
                                      layout, state_dtype)
    plan = estimate(units, world=world, dtype=dtype, state_dtype=state_dtype, stage=3, offload_params=params,
                    offload_optimizer=opt, prefetch_depth=prefetch_depth, sub_group_size=sub_group_size,
                    grad_clip=grad_clip, device=device, **layout)
    try:
        device_budget, host_budget = plan.budgets(None, None, machine.ram_available)
    except ValueError:  # the smallest budgets exceed what is available: said below, with the figures
        device_budget, host_budget = plan.device_min, plan.host_min
    derived = None
    if _ram(plan.device_min, plan.host_min, activations, device) <= machine.ram_available < _ram(
            device_budget, host_budget, activations, device):  # the derived budgets are too large, the least fit
        derived = (device_budget, host_budget)
        device_budget, host_budget = plan.device_min, plan.host_min
    short = []
    ram = _ram(device_budget, host_budget, activations, device)
    if ram > machine.ram_available:
        short.append(f"RAM: the budgets and a step's activations take {human_bytes(ram)}, "
                     f"{human_bytes(machine.ram_available)} is available")
    if device == "cuda" and device_budget > GPU_SHARE * machine.gpu_bytes:
        short.append(f"GPU: the device budget is {human_bytes(device_budget)}, "
                     f"{human_bytes(machine.gpu_bytes)} on {machine.gpu or 'no GPU'}")
    if plan.nvme.total > machine.nvme_free:
        short.append(f"NVMe: {human_bytes(plan.nvme.total)} of swap files, {human_bytes(machine.nvme_free)} free in "
                     f"{machine.nvme_dir}")
    return Verdict(dtype, 3, params, opt, device_budget, host_budget, plan.nvme.total, activations, why, tuple(short),
                   derived)


def _ram(device_budget: int, host_budget: int, activations: int, device: str) -> int:
    """Host memory a run takes: its host budget and activations, and on a CPU its device budget too."""
    return host_budget + activations + (device_budget if device == "cpu" else 0)


def verdict_lines(v: Verdict, machine: Machine) -> list[str]:
    lines = [machine.describe() + "."]
    where = f"ZeRO-3, parameters {v.offload_params}, optimizer states {v.offload_optimizer} ({v.why})"
    need = (f"budgets {human_bytes(v.device_budget)} device and {human_bytes(v.host_budget)} host, "
            f"{human_bytes(v.nvme_bytes)} on NVMe, activations {human_bytes(v.activations)}")
    if v.fits and v.derived is not None:
        lines.append(f"fits at smaller budgets than the derived ones ({human_bytes(v.derived[0])} device, "
                     f"{human_bytes(v.derived[1])} host, which with the activations exceed the RAM available): "
                     f"{where}; {need}; the store pages more, so the step is slower.")
        lines.append(f"  outcore train ... {v.flags()}")
    elif v.fits:
        lines.append(f"fits: {where}; {need}.")
        lines.append(f"  outcore train ... {v.flags()}")
    else:
        lines.append(f"does not fit: {where}; {need}. Short: {'; '.join(v.short)}.")
        lines.append("  free what is short (another --nvme-dir, a machine with more memory), or lower --batch/--seq")
    return lines


def room_beside_budgets(v: Verdict, machine: Machine, device: str, max_memory: int | None) -> tuple[int, int, str]:
    """The memory a step's own tensors (activations, a KV cache) live in, what the verdict's budgets
    leave of it, and its name: on a CPU the RAM available, or --max-memory, less this process and
    the slack, as `outcore train` counts them (tools/memory_bound.py); on a GPU its memory."""
    if device == "cpu":
        total, where = (max_memory, f"--max-memory {human_bytes(max_memory)}") if max_memory is not None else (
            machine.ram_available, f"the {human_bytes(machine.ram_available)} of RAM available")
        slack = int(max_memory * SLACK) if max_memory is not None else 0
        return total, total - slack - v.device_budget - v.host_budget - psutil.Process().memory_info().rss, where
    total = int(GPU_SHARE * machine.gpu_bytes)
    return total, total - v.device_budget, f"{machine.gpu or 'the GPU'}'s memory"


def longest_context(v: Verdict, machine: Machine, shape: Shape, *, batch: int, dtype: str, checkpointed: bool,
                    device: str, max_memory: int | None, pieces: bool = False) -> tuple[int, list[str]]:
    """`estimate --max-seq`: the longest `--seq` whose activations fit beside the verdict's budgets, in
    the memory where they live (on a CPU the RAM available, or --max-memory, less this process, as
    `outcore train`'s preflight counts them; on a GPU its memory), and what to say of it. `pieces`:
    the loss over chunks, MLP tiles and paged block inputs as `outcore train --model` chooses them."""
    total, room, where = room_beside_budgets(v, machine, device, max_memory)
    how: dict[str, Any] = {}
    if pieces:  # as `outcore train --model` computes the step (tools/sequence_pieces.py)
        how = chosen_by_train(shape, max_memory, memory=total)
    seq = longest_seq(shape, batch=batch, dtype=dtype, checkpointed=checkpointed, room=room, **how)
    if seq < 1:
        return 0, [f"longest context: none; the budgets leave {human_bytes(max(room, 0))} of {where} for activations"]
    need = sum(activation_rows(shape, batch=batch, seq=seq, dtype=dtype, checkpointed=checkpointed, **how).values())
    kept = "checkpointed" if checkpointed else "kept whole"
    if pieces:
        kept += ", the loss over chunks, MLPs tiled as train chooses"
    return seq, [f"longest context: --seq {seq:,} at --batch {batch} ({human_bytes(need)} of activations, {kept}; "
                 f"{human_bytes(room)} of {where} beside the budgets)",
                 f"  outcore train ... --batch {batch} --seq {seq} {v.flags()}"]
