"""The engine's placement, chunking and overlap rules, written once.

`StatePolicy` is the small frozen record every component that lays out or moves model states reads:
the engine, `FlatUnit`, the memory plan and `outcore estimate`. It is built from a `Config` plus
what only the run knows (world size, device type), or field by field by `estimate` for a machine
that is not this one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from outcore.offload.residency import Tier

if TYPE_CHECKING:  # resolved on use, so that the command line loads without torch
    import torch

OFFLOADS = ("none", "cpu", "nvme")  # the names `offload_params` and `offload_optimizer` take
ACTIVATION_OFFLOADS = ("auto", "none", "cpu", "nvme")  # the names `Config.offload_activations` takes
TIER_OF_OFFLOAD = {"none": Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.NVME}
DTYPES = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2), "fp16": ("float16", 2)}  # name: (torch's, bytes)
STATE_DTYPES = ("fp32", "bf16")  # what optimizer states may be stored in (`Config.state_dtype`)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a compute dtype's name ("fp32", "bf16", "fp16")."""
    import torch

    return getattr(torch, DTYPES[name][0])
HANDED_OVER = 2  # overlapped updates holding their gradient shard in memory at once


def padded_numel(numel: int, world: int, elem_size: int) -> int:
    """A unit's flat buffer length: split evenly across ranks, each shard a whole number of pages."""
    align = world * max(1, 4096 // elem_size)
    return -(-max(numel, 1) // align) * align


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a unit's states rest and where its update runs."""

    param_tier: Tier  # where parameter shards rest
    opt_tier: Tier  # where [master|m|v] rests
    work_tier: Tier  # where grads live and the update runs (DEVICE when nothing is offloaded)
    # Units whose optimizer states rest in HOST though the config puts them on NVMe (runtime/
    # memory_plan.py [Note: kept optimizer states]); the others' are written back after each update.
    kept: frozenset[int] = frozenset()

    def opt_home(self, unit: int) -> Tier:
        """Where unit `unit`'s optimizer states rest."""
        return Tier.HOST if self.opt_tier == Tier.NVME and unit in self.kept else self.opt_tier

    def opt_returns_home(self, unit: int) -> bool:
        """The store hint for unit `unit`'s optimizer-state keys: back to NVMe once updated
        (`TieredStore.put`)."""
        return self.opt_home(unit) == Tier.NVME

    @property
    def param_returns_home(self) -> bool:
        """The store hint for parameter shards: those resting in HOST go back there once updated.
        Those resting on NVMe stay where the update found them (runtime/optimizer.py [Note:
        updated parameters stay put])."""
        return self.param_tier == Tier.HOST


@dataclass(frozen=True, slots=True)
class StatePolicy:
    """How one rank's model states are laid out, where they rest, and when updates may run."""

    world: int
    stage: int
    offload_params: str
    offload_optimizer: str
    dtype: str  # "fp32" | "bf16" | "fp16"
    device_type: str  # "cpu" | "cuda"
    prefetch_depth: int
    sub_group_size: int
    clipping: bool
    grad_accumulation: int = 1
    state_dtype: str = "fp32"  # the optimizer states' storage: "fp32" or "bf16"
    # This torch can swap two storages' memory (runtime/storage_swap.py), so one rank borrows stored
    # shards; `outcore estimate` assumes a torch that can.
    storage_swap: bool = True

    @classmethod
    def of(cls, config, *, world: int, device_type: str) -> StatePolicy:
        """The policy of `config` (an `outcore.Config`) on `world` ranks of `device_type`."""
        from outcore.runtime.storage_swap import storage_swap_available

        policy = cls(world=world, stage=config.stage, offload_params=config.offload_params,
                     offload_optimizer=config.offload_optimizer, dtype=config.dtype, device_type=device_type,
                     prefetch_depth=config.prefetch_depth, sub_group_size=config.sub_group_size,
                     clipping=config.grad_clip is not None, grad_accumulation=config.grad_accumulation,
                     state_dtype=config.state_dtype)
        if policy.borrowing and not storage_swap_available():  # asked (and said) only where it matters
            policy = replace(policy, storage_swap=False)
        return policy

    # -- placement --------------------------------------------------------------------------------

    @property
    def placement(self) -> Placement:
        opt_tier = TIER_OF_OFFLOAD[self.offload_optimizer]
        return Placement(param_tier=TIER_OF_OFFLOAD[self.offload_params], opt_tier=opt_tier,
                         work_tier=Tier.DEVICE if opt_tier == Tier.DEVICE else Tier.HOST)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def elem(self) -> int:
        """Bytes per parameter in the compute dtype."""
        return DTYPES[self.dtype][1]

    @property
    def resident(self) -> bool:
        """Units keep their whole parameters between steps: stages 1 and 2, or one rank whose
        parameters rest on DEVICE (there the shard is the whole unit)."""
        return self.stage < 3 or (self.world == 1 and self.offload_params == "none")

    @property
    def aliased(self) -> bool:
        """One rank, parameters on DEVICE: each unit's flat buffer *is* its stored shard."""
        return self.world == 1 and self.resident and self.offload_params == "none"

    @property
    def borrowing(self) -> bool:
        """One rank under ZeRO-3 with offloaded parameters, on a torch that can swap storages' memory:
        a gathered unit borrows the store's buffer."""
        return self.world == 1 and not self.resident and self.storage_swap

    @property
    def master_is_param(self) -> bool:
        """Whether a unit's parameter shard is its master weights, updated in place: in fp32, and in
        bf16 with bf16 optimizer states.

        In fp32 the master would repeat the parameters byte for byte: one copy fewer to store, read,
        write and refresh after each update. The update fetches the parameter shard to where it
        runs, so the exception is a GPU whose parameters rest on it while the update runs in HOST:
        there a separate master in HOST keeps the parameters on the device.
        """
        on_gpu_apart = (self.device_type == "cuda" and self.offload_params == "none"
                        and self.offload_optimizer != "none")
        # bf16 states: a bf16 parameter shard is as precise as a bf16 master would be
        return (self.dtype == "fp32" or (self.dtype == "bf16" and self.state_dtype == "bf16")) and not on_gpu_apart

    @property
    def state_elem(self) -> int:
        """Bytes per element of a stored optimizer state (a moment, or a master kept apart)."""
        return 2 if self.state_dtype == "bf16" else 4

    @property
    def device_window(self) -> int:
        """Units of the prefetch window asked all the way onto DEVICE.

        On a GPU the nearer half (at least one): the rest is read from NVMe into HOST and copied up
        as it comes near, so the disk reads far ahead while GPU memory holds only what runs soon. On
        a CPU DEVICE and HOST are the same RAM and a shard changes tier without a copy, so a second
        level saves no memory: the whole window goes to DEVICE.
        """
        depth = max(0, self.prefetch_depth)
        return depth if self.device_type == "cpu" else max(1, (depth + 1) // 2)

    # -- chunking ---------------------------------------------------------------------------------

    def chunk_bounds(self, shard: int) -> list[tuple[int, int]]:
        """[start, end) of each optimizer chunk of a unit's shard of `shard` elements. An aliased
        unit is one chunk: its flat buffer is the stored shard, updated in one piece."""
        step = self._chunk_step(shard)
        return [(a, min(a + step, shard)) for a in range(0, shard, step)]

    def chunk_sizes(self, shard: int) -> list[tuple[int, int]]:
        """The chunks of `chunk_bounds(shard)` as (elements, how many), without listing each one: a
        memory plan of trillions of parameters counts them in constant time."""
        step = self._chunk_step(shard)
        full, rest = divmod(shard, step) if shard else (0, 0)
        return [(size, n) for size, n in ((step, full), (rest, 1 if rest else 0)) if n]

    def _chunk_step(self, shard: int) -> int:
        return max(1, shard if self.aliased else min(self.sub_group_size, shard))

    # -- when updates run -------------------------------------------------------------------------

    @property
    def overlapped(self) -> bool:
        """Each unit's update may run during backward, as soon as its gradient is final: nothing
        needs every gradient first (no global-norm clipping, no fp16 overflow check), and there is
        I/O to hide (see `step_in_memory`)."""
        return not self.clipping and self.dtype != "fp16" and not self.step_in_memory

    @property
    def speculates(self) -> bool:
        """Clipping whose updates may run behind backward before the norm is known
        (runtime/update_stream.py [Note: speculative clipping]): the optimizer states rest on NVMe,
        where keeping the old ones costs nothing; fp32 parameter shards that are their own masters,
        and fp32 states, so that a redo finds the gradient again in the first moments; ZeRO-3
        shards, not parameters resident on every rank."""
        return (self.clipping and self.dtype == "fp32" and self.state_dtype == "fp32" and self.master_is_param
                and self.offload_optimizer == "nvme" and not self.resident)

    @property
    def step_in_memory(self) -> bool:
        """Nothing to stream: one rank, fp32, every state in device memory (the flat buffers are the
        stored shards), one backward pass per step and no clipping. The gradients then stay as
        autograd made them until `step()`, which updates every unit in one fused call, as
        torch.optim.AdamW(fused=True) does: run during backward, the updates would only take cores
        from it, with no I/O to hide, and a copy of each gradient into the store would only cost."""
        return (self.aliased and self.offload_optimizer == "none" and self.dtype == "fp32"
                and self.state_dtype == "fp32" and self.grad_accumulation == 1 and not self.clipping)

    @property
    def needs_norm(self) -> bool:
        """The global gradient norm is computed only where a step needs it: to clip, or to find an
        fp16 overflow (else `step()` reports it as None)."""
        return self.clipping or self.dtype == "fp16"

    @property
    def hands_over(self) -> bool:
        """An overlapped update of a single micro-step takes its gradient shard as it is, in memory,
        when that is already where the update runs (always on a CPU): no store key, no copy."""
        return self.hands_over_window(self.grad_accumulation)

    def hands_over_window(self, micro_steps: int, *, speculating: bool = False) -> bool:
        """`hands_over` for a window of `micro_steps` backward passes (train_batch's is one), and
        for a speculated update (`speculating`), which takes its gradient as an overlapped one does."""
        work_on_device = self.offload_optimizer == "none"
        return (self.overlapped or speculating) and micro_steps == 1 and (self.device_type == "cpu" or work_on_device)
