"""The host memory an `outcore train` run will take, added up before step 1 from what decides it:
this process as it stands (the interpreter, torch, the data), the store's budgets in host memory
(derived from the memory plan where not given; on a CPU the device budget is host memory too) and
one step's activations (tools/activations.py). Where `--max-memory` is given, the whole must fit
in it: the offload setting is chosen so that it does, a derived host budget is lowered to what is
left (the store then pages more to NVMe), and a run that cannot fit is refused before step 1 with
this arithmetic. `--json` carries the arithmetic as "memory".
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

import psutil
import torch

from outcore.runtime.memory_plan import MemoryPlan
from outcore.runtime.sizes import human_bytes
from outcore.tools.activations import available_memory
from outcore.tools.estimate import estimate

# From the least offloading to the most. The parameters on NVMe with the optimizer states in memory come
# before the states on NVMe: a LoRA run's base is its bytes (read in place from its files, no swap file)
# and its states are small; a full fine-tune's states (12 bytes a parameter) fit where its parameters
# did not only rarely, and then reading 2 bytes a parameter twice a step beats writing 12.
OFFLOAD_LADDER = [("none", "none"), ("none", "cpu"), ("cpu", "cpu"), ("nvme", "none"), ("nvme", "cpu"),
                  ("cpu", "nvme"), ("nvme", "nvme")]
SLACK = 0.05  # of --max-memory, kept for what the run allocates beyond these figures (the model's
# skeleton and hooks, the allocator's own slack)


class RunDoesNotFit(ValueError):
    """--max-memory cannot hold the run even at its smallest budgets (`smallest`: the process, those
    budgets and the slack, in bytes, beside the activations in compute dtype `dtype`)."""

    def __init__(self, message: str, smallest: int, dtype: str) -> None:
        super().__init__(message)
        self.smallest, self.dtype = smallest, dtype


@dataclass
class MemoryBound:
    max_memory: int | None  # --max-memory; None: no bound but the machine's
    activations: int  # one step's activations (0 where the model's shape is unknown)
    process: int  # this process's resident bytes now

    @classmethod
    def now(cls, max_memory: int | None, activations: int) -> MemoryBound:
        return cls(max_memory, activations, psutil.Process().memory_info().rss)

    def room_for_states(self) -> int:
        """Host bytes the store's budgets may take: under --max-memory what the process and the
        activations leave of it; else half of the memory available (the rest for everything else)."""
        if self.max_memory is None:  # half, unless the activations need more of the rest
            available = available_memory()
            return min(available // 2, available - self.activations)
        return int(self.max_memory * (1 - SLACK)) - self.process - self.activations

    def budgets(self, plan: MemoryPlan, device_budget: int | None, host_budget: int | None,
                on_cpu: bool, dtype: str) -> tuple[int, int, str | None]:
        """The budgets the engine will take under `plan` (given, or derived as it derives them) and,
        under --max-memory, a derived host budget lowered to fit; also what was lowered, in words.
        RunDoesNotFit, with the arithmetic, where even the smallest budgets do not fit."""
        device, host = plan.budgets(device_budget, host_budget, available_memory())
        in_ram = device if on_cpu else 0
        if self.max_memory is None or in_ram + host <= self.room_for_states():
            return device, host, None
        lowered = self.room_for_states() - in_ram
        if host_budget is None and lowered >= plan.host_min:
            return device, lowered, (f"host budget {human_bytes(lowered)} (derived: {human_bytes(host)}), to fit "
                                     f"--max-memory {human_bytes(self.max_memory)}")
        least = plan.host_min if host_budget is None else host
        slack = int(self.max_memory * SLACK)
        raise RunDoesNotFit(f"--max-memory {human_bytes(self.max_memory)} cannot hold this run: "
                         f"{self.arithmetic(in_ram, least)} + slack {human_bytes(slack)} at the "
                         f"smallest host budget. Raise --max-memory, lower --batch or --seq, or offload more "
                         "(--offload-params/--offload-optimizer nvme) where something is not on NVMe yet.",
                            self.process + in_ram + least + slack, dtype)

    def arithmetic(self, device_in_ram: int, host: int) -> str:
        total = self.process + device_in_ram + host + self.activations
        return (f"this process {human_bytes(self.process)} + device budget in host memory "
                f"{human_bytes(device_in_ram)} + host budget {human_bytes(host)} + activations "
                f"{human_bytes(self.activations)} = {human_bytes(total)}")

    def as_json(self, device_in_ram: int, host: int) -> dict:
        return {"max_memory": self.max_memory, "process": self.process, "device_budget_in_ram": device_in_ram,
                "host_budget": host, "activations": self.activations,
                "slack": 0 if self.max_memory is None else int(self.max_memory * SLACK),
                "total": self.process + device_in_ram + host + self.activations
                + (0 if self.max_memory is None else int(self.max_memory * SLACK))}


def choose_offload(units: list[int], dtype: str, stage: int, grad_clip: float | None,
                   prefetch_depth: int, bound: MemoryBound, layout: dict | None = None,
                   state_dtype: str = "fp32") -> tuple[str, str, str]:
    """The least offloading whose device + host bytes fit in the room `bound` leaves for them: half
    of the available memory, or under --max-memory what the process and the activations leave.
    `layout`: what the run keeps of each unit (`estimate`'s keywords: frozen units without gradient
    or optimizer state, a base read in place from its files, a quantized base at its stored bytes),
    so that a LoRA or QLoRA run is not paged as though every unit trained."""
    avail = psutil.virtual_memory().available
    room = bound.room_for_states()
    where = (f"half of the {human_bytes(avail)} available" if bound.max_memory is None else
             f"the {human_bytes(max(room, 0))} that --max-memory {human_bytes(bound.max_memory)} leaves beside this "
             f"process and the activations")
    cuda = torch.cuda.is_available()
    gpu_free = torch.cuda.mem_get_info()[0] if cuda else 0
    for params, opt in OFFLOAD_LADDER:
        if params != "none" and stage < 3:
            continue
        plan = estimate(units, dtype=dtype, state_dtype=state_dtype, stage=stage, offload_params=params,
                        offload_optimizer=opt, prefetch_depth=prefetch_depth, grad_clip=grad_clip,
                        device="cuda" if cuda else "cpu", **(layout or {}))
        ram = plan.host.states + plan.host.runtime + (0 if cuda else plan.device.total)
        fits_device = plan.device.total <= 0.8 * gpu_free if cuda else True
        if fits_device and ram <= room:
            return params, opt, f"{human_bytes(ram)} of states and buffers fit in {where}"
    return "nvme", "nvme", f"the model's states exceed {where}"


def address_space_note() -> str | None:
    """Said before a run starts where a `ulimit -v` is set: it may fail far below the limit, and in
    a thread library outcore cannot catch (libgomp aborts the process)."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    return (f"the address space is limited to {human_bytes(limit)} (ulimit -v): threads and allocators reserve "
            "address space well beyond the memory they use, so the run may fail far below it; lift it and bound the "
            "run with --max-memory instead")


def address_space_hint(error: BaseException) -> str | None:
    """Where a run failed for want of address space under a `ulimit -v` (RLIMIT_AS), what to do,
    in words; None for any other failure. Threads reserve their stacks and allocators their arenas
    as address space well beyond the memory they use, so such a limit fails far below what the run
    needs, as "can't start new thread" or a failed allocation."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    text = str(error)
    starved = isinstance(error, MemoryError) or any(
        words in text for words in ("can't start new thread", "can't allocate memory", "Cannot allocate memory"))
    if limit == resource.RLIM_INFINITY or not starved:
        return None
    return (f"the process's address space is limited to {human_bytes(limit)} (ulimit -v), and threads and allocators "
            "reserve address space well beyond the memory they use: lift that limit (ulimit -v unlimited) and bound "
            "the run with --max-memory instead, which counts memory used")
