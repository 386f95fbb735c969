"""Bytes per tier for one rank, from the unit layout and the config: what the engine sizes its
budgets with, and what `outcore estimate` prints, so the two can never disagree.

Three kinds of bytes:
- states: model states at rest where the config puts them (parameter shards in the compute dtype,
  fp32 optimizer states per chunk: [m|v] when the fp32 parameter shard is the master itself,
  [master|m|v] otherwise; see `StatePolicy.master_is_param`);
- runtime: what the store holds while a step runs: the prefetch window of parameter shards (on a
  GPU its nearer half on DEVICE, the rest in HOST; see `StatePolicy.device_window`),
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

from dataclasses import dataclass, replace

from outcore.runtime.policy import HANDED_OVER, StatePolicy, padded_numel

PAGE = 4096
# Bytes of optimizer states an update streaming from NVMe keeps on their way where the host budget
# has room for them: [Note: optimizer read-ahead].
READ_AHEAD_BYTES = 96 << 20


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def _chunk_pages(sizes: list[tuple[int, int]], elem_bytes: int) -> int:
    """Page-rounded bytes of chunks given as (elements, count), each chunk its own key."""
    return sum(n * _pages(size * elem_bytes) for size, n in sizes)


@dataclass(frozen=True, slots=True)
class UnitShape:
    """One unit as the plan sees it: elements of this rank's shard and of the whole (padded) buffer."""

    shard: int
    padded: int
    frozen: bool = False  # no gradient, no optimizer state (runtime/units.py [Note: frozen units])
    root: bool = False  # the root unit or its frozen sibling: gathered from first forward to last backward
    module: int = 0  # units of one module (a unit and its frozen sibling) share it: gathered together
    outer: bool = False  # a large module outside the blocks (an untied head, an embedding)
    stored: int | None = None  # bytes of the shard as stored, where not `shard` elements (a quantized unit)


def unit_shapes(numels: list[int], policy: StatePolicy, *, frozen: list[bool] | None = None,
                roots: list[bool] | None = None, modules: list[int] | None = None,
                outer: list[bool] | None = None, stored: list[int | None] | None = None) -> list[UnitShape]:
    """Shapes of units of `numels` parameters each. Without `roots`, the last unit is the root's;
    without `modules`, every unit is a module of its own (no frozen siblings); without `outer`, no
    unit is a large module outside the blocks."""
    n = len(numels)
    frozen = frozen or [False] * n
    roots = roots or [i == n - 1 for i in range(n)]
    modules = modules or list(range(n))
    outer = outer or [False] * n
    stored = stored or [None] * n
    out = []
    for numel, fz, root, module, big, nbytes in zip(numels, frozen, roots, modules, outer, stored, strict=True):
        padded = padded_numel(numel, policy.world, policy.elem)
        out.append(UnitShape(padded // policy.world, padded, fz, root, module, big, nbytes))
    return out


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
    host_needs: tuple[tuple[str, int], ...] = ()  # what host_min holds, (what, bytes): their sum
    optimizer_states: int = 0  # every chunk's fp32 optimizer state, wherever it rests
    optimizer_on_nvme: bool = False
    unit_states: tuple[int, ...] = ()  # each unit's optimizer-state bytes, by unit index (0: frozen)
    entry: tuple[int, ...] = ()  # the units whose updates backward cannot hide (see `plan_memory`)
    # Optimizer chunks an update reads ahead: at the least (`host_min` counts that) and with room
    # (the host runtime counts that); see `read_ahead`.
    read_ahead_least: int = 1
    read_ahead_ample: int = 1

    # [Note: optimizer read-ahead] An update streaming its optimizer states from NVMe reads the next
    # chunks' states while it updates one, and the disk is busy only while reads and write-backs
    # are queued. `prefetch_depth` small chunks left it idle between them at default budgets, and
    # backward waited on the updates; chunks worth READ_AHEAD_BYTES kept it busy: it is the bytes
    # ahead that count, not the chunks. Under a host budget short of the plan's HOST bytes the same
    # read-ahead cost more than it gained: it evicted what the step read again, so there it stays
    # at `prefetch_depth` (both measured in docs/benchmarks.md).

    # [Note: kept optimizer states] Under NVMe offload the optimizer states of some units may rest
    # in HOST instead, where the host budget has room beside this plan's HOST bytes: the entry
    # units' first, then the others in unit order (`kept_units`). Backward cannot hide the entry
    # units' updates: an input embedding's gradient is final last, and the next forward waited for
    # its states to be read and written; an untied head's is final first, and every update queued
    # behind its states. Kept by choice, not cached by least-recent use, which pushed out what the
    # next forward reads first and moved more bytes a step (docs/benchmarks.md). The default host
    # budget holds the entry units' states.

    @property
    def entry_states(self) -> int:
        """Bytes of the entry units' optimizer states, where they would rest on NVMe."""
        return sum(self.unit_states[i] for i in self.entry) if self.optimizer_on_nvme else 0

    def room(self, host_budget: int) -> int:
        """What `host_budget` leaves beside this plan's HOST bytes (negative: short of them)."""
        return host_budget - (self.host.states + self.host.runtime)

    def read_ahead(self, host_budget: int) -> int:
        """Optimizer chunks an update reads ahead under `host_budget`: [Note: optimizer read-ahead]."""
        return self.read_ahead_ample if self.room(host_budget) >= 0 else self.read_ahead_least

    def kept_units(self, host_budget: int) -> frozenset[int]:
        """The units whose optimizer states rest in HOST under `host_budget`: the entry units, then
        the others in unit order, as long as each fits in what the budget leaves."""
        if not self.optimizer_on_nvme:
            return frozenset()
        room = self.room(host_budget)
        kept: list[int] = []
        for i in [*self.entry, *(i for i in range(len(self.unit_states)) if i not in self.entry)]:
            if self.unit_states[i] > room:
                break
            room -= self.unit_states[i]
            kept.append(i)
        return frozenset(i for i in kept if self.unit_states[i])

    def keeps_optimizer_states(self, host_budget: int) -> bool:
        """Whether `host_budget` keeps every optimizer state in HOST (none is read or written a step)."""
        return self.optimizer_on_nvme and len(self.kept_units(host_budget)) == sum(1 for n in self.unit_states if n)

    def placed(self, kept: frozenset[int]) -> MemoryPlan:
        """This plan with the optimizer states of `kept` in HOST instead of on NVMe."""
        moved = sum(self.unit_states[i] for i in kept) if self.optimizer_on_nvme else 0
        return replace(self, host=replace(self.host, states=self.host.states + moved),
                       nvme=replace(self.nvme, states=self.nvme.states - moved))

    def at_default_budgets(self) -> MemoryPlan:
        """The plan as the engine lays it out under budgets it derives itself, memory permitting."""
        return self.placed(self.kept_units(self.budgets(None, None, 1 << 62)[1]))

    def budgets(self, device_budget: int | None, host_budget: int | None, available: int) -> tuple[int, int]:
        """The budgets given, or derived from this plan and the `available` host memory; checked
        against the smallest working set, so that a budget too small fails here with the number
        that works."""
        device = device_budget or max(self.device.states + self.device.runtime, self.device_min)
        host = host_budget or max(self.host_min, min(self.host.states + self.host.runtime + self.entry_states,
                                                     available // 2))
        if device < self.device_min:
            raise ValueError(f"device_budget={device:,} bytes cannot hold what must stay on the device "
                             f"({self.device_min:,} bytes for this model and offload setting); raise it or "
                             "offload more.")
        if host < self.host_min:
            needs = "; ".join(f"{what}: {n:,}" for what, n in self.host_needs)
            chunks = ", or lower sub_group_size" if self.optimizer_on_nvme else ""
            raise ValueError(f"host_budget={host:,} bytes cannot hold what host memory must hold at once "
                             f"({self.host_min:,} bytes; {needs}); raise it to at least that{chunks}.")
        return device, max(host, 4096)

    def as_dict(self) -> dict:
        return {tier: {"states": b.states, "runtime": b.runtime, "gathered": b.gathered, "total": b.total}
                for tier, b in (("device", self.device), ("host", self.host), ("nvme", self.nvme))}


def plan_memory(units: list[UnitShape], policy: StatePolicy, *, frozen_in_files: bool = False) -> MemoryPlan:
    """Per-rank bytes of every tier for these units. Overlapped updates (`policy.overlapped`) of a
    one-micro-step window drop each unit's gradient as soon as it is final, so gradients of a few
    units are alive at once instead of all of them until the step. Frozen units count their
    parameters only, and on NVMe not even those when `frozen_in_files`: read where the weights
    files hold them (runtime/frozen_in_place.py)."""
    depth = max(1, policy.prefetch_depth)
    near = max(1, policy.device_window)  # the plan counts at least one unit ahead
    elem, overlapped, device_type = policy.elem, policy.overlapped, policy.device_type
    params_on, opt_on = policy.offload_params, policy.offload_optimizer
    work_on_device = opt_on == "none"
    resident, aliased, in_place = policy.resident, policy.aliased, policy.master_is_param
    state_elem = (2 if in_place else 3) * policy.state_elem  # [m|v] or [master|m|v]
    sizes = [policy.chunk_sizes(u.shard) for u in units if not u.frozen]  # (elements, count) per unit
    chunk = max((size for ss in sizes for size, _ in ss), default=0)
    n_chunks = sum(n for ss in sizes for _, n in ss)

    def stored(u: UnitShape) -> int:
        return u.stored if u.stored is not None else u.shard * elem

    param_all = sum(_pages(stored(u)) for u in units)  # one key per unit
    unit_states = tuple(0 if u.frozen else _chunk_pages(policy.chunk_sizes(u.shard), state_elem) for u in units)
    state_all = sum(unit_states)
    grad_all = sum(_chunk_pages(ss, 4) for ss in sizes)
    # One micro-step, overlapped, and the gradient already where the update runs: the update takes
    # the shard itself (no store key), and backward waits while HANDED_OVER of them are in flight.
    handed_over = policy.hands_over
    # Every unit's gradient lives until the step, except in an overlapped window of one micro-step:
    # there each unit's update takes its gradient as soon as it is final.
    per_unit = overlapped and policy.grad_accumulation == 1
    if per_unit:
        grad_all = max((_chunk_pages(ss, 4) for ss in sizes), default=0)
    largest_unit = max(_pages(stored(u)) for u in units)
    full = [_pages(u.padded * elem) for u in units]
    # ZeRO-3 holds the root unit (outside the repeated blocks, needed from the first forward to the
    # last backward) and, in backward, the unit computing and the one whose output gradient it made
    # (each with its frozen sibling).
    # A model with no parameters of its own has no root unit: its last unit stands in for it.
    roots = [u.root for u in units] if any(u.root for u in units) else [i == len(units) - 1 for i in range(len(units))]
    by_module: dict[int, int] = {}
    for u, f, root in zip(units, full, roots, strict=True):
        if not root:
            by_module[u.module] = by_module.get(u.module, 0) + f + PAGE
    blocks = sorted(by_module.values(), reverse=True)[:2]
    held = sum(f + PAGE for f, root in zip(full, roots, strict=True) if root) + sum(blocks)
    borrowing = policy.borrowing

    dev = dict(states=0, runtime=0, gathered=0)
    host = dict(states=0, runtime=0, gathered=0)
    nvme = dict(states=0, runtime=0, gathered=0)
    where = {"none": dev, "cpu": host, "nvme": nvme}
    where[params_on]["states"] += param_all
    if params_on == "nvme" and frozen_in_files:
        nvme["states"] -= sum(_pages(u.shard * elem) for u in units if u.frozen and u.stored is None)
    where[opt_on]["states"] += state_all

    if params_on == "none":
        dev_min = param_all
    elif borrowing:  # the gathered units are the stored shards, pinned; the prefetch window beside them
        dev_min = held
        dev["runtime"] += held + near * (largest_unit + PAGE)
    else:  # the prefetch window of whole units' shards
        dev_min = 2 * (largest_unit + PAGE)
        dev["runtime"] += max((near + 1) * (largest_unit + PAGE), dev_min)
    # What the smallest host budget must hold, (what, bytes); host_min is their sum.
    host_needs = [("the parameters, which rest there", param_all)] if params_on == "cpu" else []
    if params_on == "nvme":
        # Updated shards stay in memory and reach NVMe only when evicted (on a CPU, one evicted from
        # DEVICE goes to HOST first while HOST has room): with room, HOST caches them all.
        host["runtime"] += param_all
        host_needs.append(("the largest unit's parameters read from NVMe", largest_unit + PAGE))
    work = dev if work_on_device else host
    if handed_over:
        work["gathered"] += grad_all * HANDED_OVER
    elif per_unit:
        # Store keys: backward waits while HANDED_OVER updates run (runtime/update_stream.py), and
        # puts the next unit's gradient meanwhile.
        work["runtime"] += grad_all * (HANDED_OVER + 1)
    else:
        work["runtime"] += grad_all
    # The update holds one unit's parameter shard: aliased ones and, on a CPU, the master ones where
    # they rest; on a GPU a master is fetched to the work tier; otherwise a new shard is staged
    # beside the old one.
    work_name = "none" if work_on_device else "cpu"
    if not aliased and not in_place:
        where["cpu" if params_on == "nvme" else params_on]["runtime"] += largest_unit
    elif not aliased and device_type != "cpu" and params_on != work_name:
        where[work_name]["runtime"] += largest_unit
    if policy.state_dtype == "bf16" and n_chunks:  # the update's fp32 copies of a chunk, and its rounding bits
        copies = _pages(chunk * (3 * 4 + 4))
        work["runtime"] += copies
        if not work_on_device:
            host_needs.append(("one optimizer chunk in fp32 while it updates", copies))
    if policy.speculates:
        # Speculative clipping keeps each unit's states aside until the step: on NVMe where they were
        # read from it, the earlier extents not yet reused (runtime/update_stream.py [Note:
        # speculative clipping]); copies in HOST are taken only where it has free room.
        nvme["runtime"] += state_all + param_all
    ample = depth  # optimizer chunks read ahead with room: more only when streamed from NVMe
    if work_on_device:  # states, gradients and the update all live on the device
        dev_min = dev["states"] + dev["runtime"]
    elif opt_on == "nvme":
        # Read ahead, update, write back: chunks on the way past a unit's end into the next unit's
        # (during backward, the unit expected next: runtime/update_stream.py); `depth` of them at
        # the least, READ_AHEAD_BYTES' worth with room ([Note: optimizer read-ahead]).
        chunk_states = _pages(chunk * state_elem) + PAGE
        ample = max(depth, min(-(-READ_AHEAD_BYTES // chunk_states), n_chunks))
        host["runtime"] += (ample + 1) * chunk_states
        host_needs.append((f"{depth + 1} optimizer chunks on their way to and from NVMe", (depth + 1) * chunk_states))
    else:
        host_needs.append(("the optimizer states, which rest there", state_all))
    if not aliased and not borrowing:  # stages 1-2 keep every unit whole
        dev["gathered"] = sum(full) if resident else held
    # The units whose updates backward cannot hide: the root's and the large modules outside the
    # blocks (an input embedding's gradient is final last, an untied head's first, before any
    # other update could be streaming); without such modules, the first block.
    others = [i for i, root in enumerate(roots) if not root]
    outer = [i for i in others if units[i].outer]
    entry = tuple(i for i, root in enumerate(roots) if root) + tuple(outer or others[:1])
    return MemoryPlan(TierBytes(**dev), TierBytes(**host), TierBytes(**nvme), device_min=dev_min,
                      host_min=sum(n for _, n in host_needs), host_needs=tuple(host_needs),
                      optimizer_states=state_all, optimizer_on_nvme=opt_on == "nvme", unit_states=unit_states,
                      entry=entry, read_ahead_least=depth, read_ahead_ample=ample)
