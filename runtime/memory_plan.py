"""Bytes per tier for one rank, from the unit layout and the config: what the engine sizes its
budgets with, and what `outcore estimate` prints, so the two can never disagree.

Three kinds of bytes:
- states: model states at rest where the config puts them (parameter shards in the compute dtype,
  fp32 optimizer states per chunk: [m|v] when the fp32 parameter shard is the master itself,
  [master|m|v] otherwise; see `master_is_param`);
- runtime: what the store holds while a step runs: the prefetch window of parameter shards (on a
  GPU its nearer half on DEVICE, the rest in HOST; see `device_window`),
  fp32 gradient shards accumulated until the step, the optimizer's read → update → write window,
  and updated parameter shards kept in HOST on their way to NVMe;
- gathered: buffers outside the store: whole-unit parameter buffers (the units being computed
  under ZeRO-3 with several ranks; every unit, whole, under stages 1 and 2; one rank borrows the
  stored shard instead, runtime/flat_unit.py [Note: borrowed shards], so its gathered units are
  DEVICE runtime bytes), and gradient shards handed straight to overlapped updates (at most
  `HANDED_OVER` units' worth, in the work tier's memory). Activations are the model's and not counted.
Every store key occupies whole pages, so counts are rounded per key.
"""

from __future__ import annotations

from dataclasses import dataclass

PAGE = 4096
HANDED_OVER = 2  # overlapped updates holding their gradient shard in memory at once (runtime/engine.py)


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


@dataclass(frozen=True)
class TierBytes:
    states: int = 0
    runtime: int = 0
    gathered: int = 0

    @property
    def total(self) -> int:
        return self.states + self.runtime + self.gathered


@dataclass(frozen=True)
class MemoryPlan:
    device: TierBytes
    host: TierBytes
    nvme: TierBytes
    device_min: int  # the smallest device budget the engine can run with
    host_min: int  # the smallest host budget
    optimizer_states: int = 0  # every chunk's fp32 optimizer state, wherever it rests

    def keeps_optimizer_states(self, host_budget: int, offload_optimizer: str) -> bool:
        """Whether updated NVMe optimizer states may stay in HOST rather than be written back after
        each update: only when `host_budget` holds all of them beside this plan's HOST bytes. Below
        that the write-back stays, since states cached by least-recent use would push out what the
        next forward reads first (measured: 10-45% more bytes moved per step)."""
        needed = self.host.states + self.host.runtime + self.optimizer_states
        return offload_optimizer == "nvme" and host_budget >= needed

    def as_dict(self) -> dict:
        return {tier: {"states": b.states, "runtime": b.runtime, "gathered": b.gathered, "total": b.total}
                for tier, b in (("device", self.device), ("host", self.host), ("nvme", self.nvme))}


def device_window(prefetch_depth: int, device_type: str) -> int:
    """Units of the prefetch window asked all the way onto DEVICE.

    On a GPU the nearer half (at least one): the rest is read from NVMe into HOST and copied up as
    it comes near, so the disk reads far ahead while GPU memory holds only what runs soon. On a CPU
    DEVICE and HOST are the same RAM and a shard changes tier without a copy, so a second level
    saves no memory; measured on gpt-350m it cost 3-5 s of CPU per step. There the whole window
    goes to DEVICE.
    """
    depth = max(0, prefetch_depth)
    return depth if device_type == "cpu" else max(1, (depth + 1) // 2)


def master_is_param(fp32: bool, device_type: str, offload_params: str, offload_optimizer: str) -> bool:
    """Whether a unit's fp32 parameter shard is its master weights, updated in place.

    In fp32 the master would repeat the parameters byte for byte: one copy fewer to store, read,
    write and refresh after each update. The update fetches the parameter shard to where it runs,
    so the exception is a GPU whose parameters rest on it while the update runs in HOST: there a
    separate master in HOST keeps the parameters on the device.
    """
    on_gpu_apart = device_type == "cuda" and offload_params == "none" and offload_optimizer != "none"
    return fp32 and not on_gpu_apart


def unit_chunks(shard: int, sub_group_size: int, aliased: bool) -> list[int]:
    """Elements of each optimizer chunk of one unit's shard (the engine's split)."""
    step = shard if aliased else max(1, min(sub_group_size, shard))
    return [min(step, shard - a) for a in range(0, shard, step)]


def plan_memory(shards: list[int], padded: list[int], *, elem: int, world: int, stage: int,
                offload_params: str, offload_optimizer: str, prefetch_depth: int, sub_group_size: int,
                fp32: bool, overlapped: bool, device_type: str, grad_accumulation: int = 1) -> MemoryPlan:
    """Per-rank bytes of every tier. `shards`/`padded`: elements of each unit's shard / whole buffer.
    `overlapped`: each unit is updated (and its gradient dropped) as soon as its gradient is final,
    so gradients of about one unit are alive at once instead of all of them until the step.
    `device_type`: "cpu" or "cuda", which decides how much of the prefetch window is on DEVICE."""
    depth = max(1, prefetch_depth)
    near = device_window(depth, device_type)
    params_on, opt_on = offload_params, offload_optimizer
    work_on_device = opt_on == "none"
    resident = stage < 3 or (world == 1 and params_on == "none")
    aliased = world == 1 and resident and params_on == "none"
    in_place = master_is_param(fp32, device_type, params_on, opt_on)
    state_elem = 8 if in_place else 12  # [m|v] or [master|m|v], fp32
    chunks = [unit_chunks(s, sub_group_size, aliased) for s in shards]
    flat = [c for cs in chunks for c in cs]
    chunk = max(flat)

    param_all = sum(_pages(s * elem) for s in shards)  # one key per unit
    state_all = sum(_pages(c * state_elem) for c in flat)
    grad_all = sum(_pages(c * 4) for c in flat)
    # One micro-step, overlapped, and the gradient already where the update runs: the update takes
    # the shard itself (no store key), and backward waits while HANDED_OVER of them are in flight.
    handed_over = overlapped and grad_accumulation == 1 and (device_type == "cpu" or work_on_device)
    if overlapped:
        grad_all = max(sum(_pages(c * 4) for c in cs) for cs in chunks)
    largest_unit = max(_pages(s * elem) for s in shards)
    full = [_pages(p * elem) for p in padded]
    # ZeRO-3 holds the root unit (outside the repeated blocks, needed from the first forward to the
    # last backward) and, in backward, the unit computing and the one whose output gradient it made.
    blocks = sorted(full[:-1], reverse=True)[:2]
    held = full[-1] + sum(blocks) + PAGE * (1 + len(blocks))
    borrowing = world == 1 and not resident

    dev = dict(states=0, runtime=0, gathered=0)
    host = dict(states=0, runtime=0, gathered=0)
    nvme = dict(states=0, runtime=0, gathered=0)
    where = {"none": dev, "cpu": host, "nvme": nvme}
    where[params_on]["states"] += param_all
    where[opt_on]["states"] += state_all

    if params_on == "none":
        dev_min = param_all
    elif borrowing:  # the gathered units are the stored shards, pinned; the prefetch window beside them
        dev_min = held
        dev["runtime"] += held + near * (largest_unit + PAGE)
    else:  # the prefetch window of whole units' shards
        dev_min = 2 * (largest_unit + PAGE)
        dev["runtime"] += max((near + 1) * (largest_unit + PAGE), dev_min)
    host_min = param_all if params_on == "cpu" else 0
    if params_on == "nvme":
        # Updated shards stay in memory and reach NVMe only when evicted (on a CPU, one evicted from
        # DEVICE goes to HOST first while HOST has room): with room, HOST caches them all.
        host["runtime"] += param_all
        host_min += largest_unit + PAGE
    work = dev if work_on_device else host
    work["gathered" if handed_over else "runtime"] += grad_all * (HANDED_OVER if handed_over else 1)
    # The update holds one unit's parameter shard: aliased ones and, on a CPU, the master ones where
    # they rest; on a GPU a master is fetched to the work tier; otherwise a new shard is staged
    # beside the old one.
    work_name = "none" if work_on_device else "cpu"
    if not aliased and not in_place:
        where["cpu" if params_on == "nvme" else params_on]["runtime"] += largest_unit
    elif not aliased and device_type != "cpu" and params_on != work_name:
        where[work_name]["runtime"] += largest_unit
    if work_on_device:  # states, gradients and the update all live on the device
        dev_min = dev["states"] + dev["runtime"]
    elif opt_on == "nvme":
        # Read ahead, update, write back. During backward each unit streams on its own, so a unit
        # of few chunks has fewer on the way.
        ahead = depth if not overlapped else min(depth, max(len(cs) for cs in chunks) - 1)
        window = (ahead + 1) * (_pages(chunk * state_elem) + PAGE)
        host["runtime"] += window
        host_min += window
    else:
        host_min += state_all
    if not aliased and not borrowing:  # stages 1-2 keep every unit whole
        dev["gathered"] = sum(full) if resident else held
    return MemoryPlan(TierBytes(**dev), TierBytes(**host), TierBytes(**nvme), device_min=dev_min, host_min=host_min,
                      optimizer_states=state_all)
