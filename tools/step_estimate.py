"""`outcore estimate --predict`: how long a step takes, what bounds it, and the accumulation that
hides the bytes it moves.

A step does four kinds of work, each at the machine's rate for it: compute (6 FLOPs a parameter
a token, 8 with activation checkpointing, less for frozen parameters, which need no weight
gradient), NVMe reads and writes (parameters gathered in forward and backward where the budgets
cannot cache them, optimizer states streamed once a step), host-device copies on a GPU, and the
CPU's AdamW over the offloaded states (on a CPU-only machine with the checksums of every byte the
swap file moves, which take the same cores). Updates that run beside backward (no clipping, or
speculative clipping) overlap compute, so the step is the longest of the four; updates that wait
for the norm come after it. On a CPU-only machine compute and updates take turns on the same
cores, and so do the reads of a frozen base in its own weights files, which pass through the page
cache (tools/machine_rates.py): their time adds to the step's, where the swap file's direct I/O
hides under compute. Fixed costs a step (Python, the hooks, the I/O's requests) are measured on an
engine as deep, and added.

The bytes come from the model's sizes and the memory plan's figures; the rates are the machine's,
given or measured on the spot (tools/machine_rates.py). Every number here is arithmetic on those two: the
tests check it without running a model, and docs/benchmarks.md puts it beside measured steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from outcore.runtime.memory_plan import MemoryPlan
from outcore.runtime.policy import StatePolicy

MAX_ACCUMULATION = 4096  # the search for a compute-bound step stops here


@dataclass(frozen=True)
class Rates:
    """What the machine does per second."""

    disk_read: float  # bytes/s from NVMe
    disk_write: float  # bytes/s to NVMe
    flops: float  # FLOP/s the compute device reaches on the model's matrix products
    adam: float  # parameters/s the CPU's AdamW updates (states streamed through its memory)
    host_device: float | None = None  # bytes/s between HOST and a GPU; None on a CPU (DEVICE is RAM)
    peak_flops: float | None = None  # the device's peak, for MFU
    # bytes/s one core checksums what the swap file reads and writes: on a CPU-only machine that work
    # takes the cores compute needs (None: not counted)
    checksum: float | None = None
    # seconds a step costs beyond its work: Python, the hooks' gathers and releases of every unit, the
    # I/O's requests, the loss and the optimizer's bookkeeping (`measure_overhead`)
    overhead: float = 0.0
    # bytes/s a frozen base is read from its weights files through the page cache, on a CPU-only
    # machine the cores' time (`measure_in_place_read`); None: counted as the disk's reads
    in_place_read: float | None = None
    # seconds a micro-batch's forward and backward take on the model's own shape (`measure_compute`);
    # None: its FLOPs at `flops`
    micro_batch: float | None = None

    @property
    def cpu_only(self) -> bool:
        """Compute and updates share the same cores."""
        return self.host_device is None


@dataclass(frozen=True)
class StepShape:
    """One optimizer step of a model under one offload setting, in bytes and counts per rank."""

    params: int  # every parameter the rank computes with
    trained: int  # of those, the ones with a gradient and optimizer states
    tokens: int  # tokens of one micro-batch (batch x seq)
    param_bytes: int  # this rank's parameter shards, in the compute dtype
    state_bytes: int  # this rank's optimizer states
    params_on_nvme: bool = False
    states_on_nvme: bool = False
    params_offloaded: bool = False  # off the GPU: gathered across the bus every pass
    optimizer_offloaded: bool = False  # updated by the CPU
    cache_bytes: int = 0  # room the budgets leave to cache parameter shards beside the working set
    states_in_host: int = 0  # optimizer-state bytes the host budget keeps, never streamed
    updates_overlap: bool = True  # updates run beside backward (no clipping, or speculative clipping)
    checkpointing: bool = False
    vertical: bool = False  # one train_batch a step: parameters gathered once for all micro-batches
    in_place_share: float = 0.0  # of the parameter bytes read, the share from the weights files (a frozen base)
    grad_bytes: int = 0  # this rank's fp32 gradient shards (what an accumulation window sums)


@dataclass(frozen=True)
class StepTime:
    """A step's seconds by kind of work, the step, and what bounds it."""

    accumulate: int
    compute: float
    nvme: float
    host_device: float
    optimizer: float
    step: float
    bound: str
    tokens: int
    flops: float
    nvme_read: int
    nvme_written: int
    overhead: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step if self.step else 0.0

    def mfu(self, peak_flops: float | None) -> float | None:
        """Model FLOPs over the step, as a fraction of the device's peak."""
        return self.flops / self.step / peak_flops if peak_flops and self.step else None

    def as_dict(self, peak_flops: float | None = None) -> dict:
        out = dataclasses.asdict(self)
        out.update(tokens_per_s=self.tokens_per_s, mfu=self.mfu(peak_flops))
        return out


def step_flops(shape: StepShape, accumulate: int = 1) -> float:
    """Model FLOPs of one step: forward 2 a parameter a token, backward 2 for the inputs' gradient
    and 2 more for the weights' (trained parameters only), forward again under checkpointing (and
    in a train_batch, which checkpoints every unit)."""
    per_token = 2 * shape.params + 2 * shape.params + 2 * shape.trained
    if shape.checkpointing or shape.vertical:  # a train_batch recomputes each unit's forward
        per_token += 2 * shape.params
    return float(per_token) * shape.tokens * accumulate


def step_bytes(shape: StepShape, accumulate: int = 1) -> tuple[int, int, int]:
    """(NVMe read, NVMe written, host<->device) bytes of one step.

    Parameter shards resting on NVMe that the budgets cannot cache are read by the passes that
    gather them: forward and backward of each micro-step (of the one train_batch, `vertical`),
    except that backward begins with the units forward used last, which the cache still holds;
    the trained ones are written once after their update. Optimizer states on NVMe, beyond
    those the host budget keeps, are read and written once a step. On a GPU, offloaded parameters
    cross the bus in every pass, and the fp32 gradient shard of every trained parameter comes
    down to the CPU's optimizer in every micro-step."""
    micro = 1 if shape.vertical else accumulate
    passes = 2 * micro
    read, written = parameter_reads(shape, accumulate), 0
    if shape.params_on_nvme:
        uncached = max(0, shape.param_bytes - shape.cache_bytes)
        written += uncached * shape.trained // max(1, shape.params)
    if shape.states_on_nvme:
        streamed = max(0, shape.state_bytes - shape.states_in_host)
        read += streamed
        written += streamed
    if micro > 1 and shape.params_on_nvme:
        # A window of several backward passes sums each gradient into the store: what the cache
        # left by the parameters cannot hold is written by every micro-step and read back by the
        # next one and by the update.
        spilled = max(0, shape.grad_bytes - max(0, shape.cache_bytes - shape.param_bytes))
        read += micro * spilled
        written += micro * spilled
    bus = 0
    if shape.params_offloaded:
        bus += passes * shape.param_bytes
    if shape.optimizer_offloaded:
        bus += 4 * shape.trained * micro
    return read, written, bus


def parameter_reads(shape: StepShape, accumulate: int = 1) -> int:
    """Bytes of parameter shards a step reads from NVMe (or the weights files): those the budgets
    cannot cache, in forward and backward of each micro-step, less what backward finds still cached
    from the end of forward."""
    if not shape.params_on_nvme:
        return 0
    uncached = max(0, shape.param_bytes - shape.cache_bytes)
    return (1 if shape.vertical else accumulate) * max(uncached, 2 * uncached - shape.cache_bytes)


def predict_step(shape: StepShape, rates: Rates, accumulate: int = 1) -> StepTime:
    """The step's time split and its bound at `accumulate` micro-batches a step."""
    flops = step_flops(shape, accumulate)
    read, written, bus = step_bytes(shape, accumulate)
    in_place = int(shape.in_place_share * parameter_reads(shape, accumulate))
    compute = flops / rates.flops if rates.micro_batch is None else rates.micro_batch * accumulate
    nvme = read / rates.disk_read + written / rates.disk_write
    host_device = 0.0 if rates.host_device is None else bus / rates.host_device
    optimizer = shape.trained / rates.adam if shape.optimizer_offloaded or rates.cpu_only else 0.0
    if rates.cpu_only:  # the same cores compute, update, checksum and read the base in place
        if rates.checksum:
            optimizer += (read - in_place + written) / rates.checksum
        if rates.in_place_read:
            optimizer += in_place / rates.in_place_read
            nvme -= in_place / rates.disk_read
        step = max(compute + optimizer, nvme)
        bound = "nvme" if nvme > compute + optimizer else ("compute" if compute >= optimizer else "optimizer")
    elif shape.updates_overlap:
        parts = {"compute": compute, "nvme": nvme, "host_device": host_device, "optimizer": optimizer}
        step = max(parts.values())
        bound = max(parts, key=lambda k: parts[k])
    else:  # the updates wait for the norm: after backward, streaming the states they read and write
        during = max(compute, host_device)
        after = optimizer
        step = max(during + after, nvme)
        bound = "nvme" if nvme > during + after else ("compute" if compute >= after else "optimizer")
    overhead = rates.overhead * (1 if shape.vertical else accumulate)  # a micro-step's passes each take it
    if overhead > step:
        bound = "overhead"
    return StepTime(accumulate=accumulate, compute=compute, nvme=nvme, host_device=host_device, optimizer=optimizer,
                    step=step + overhead, bound=bound, tokens=shape.tokens * accumulate, flops=flops, nvme_read=read,
                    nvme_written=written, overhead=overhead)


def compute_bound_accumulation(shape: StepShape, rates: Rates, limit: int = MAX_ACCUMULATION) -> int | None:
    """The smallest accumulation at which compute bounds the step; None if none up to `limit`
    does (bytes that grow with every micro-step, as parameters gathered from NVMe, never hide)."""
    def bound(k: int) -> str:
        return predict_step(shape, rates, k).bound

    if bound(limit) != "compute":
        return None
    low, high = 1, limit
    while low < high:  # compute's share only grows with k: the first k that is compute-bound
        mid = (low + high) // 2
        if bound(mid) == "compute":
            high = mid
        else:
            low = mid + 1
    return low


def shape_of(unit_numels: list[int], frozen: list[bool], plan: MemoryPlan, policy: StatePolicy, *, tokens: int,
             device_budget: int, host_budget: int, checkpointing: bool = False,
             vertical: bool = False, in_place_share: float = 0.0) -> StepShape:
    """The step of these units (parameters per unit, whole model) under `policy`, as `plan` lays it
    out under the given budgets. The parameter cache is what the budgets leave beside the plan's
    other bytes: on a CPU both tiers are RAM and cache shards alike."""
    world, elem = policy.world, policy.elem
    params = sum(unit_numels)
    trained = sum(n for n, f in zip(unit_numels, frozen, strict=True) if not f)
    sharded = policy.stage == 3 or policy.offload_params != "none"
    param_bytes = (params // world if sharded else params) * elem
    on_nvme = policy.offload_params == "nvme"
    cache = 0
    if on_nvme:
        host_others = plan.host.states + plan.host.runtime - param_bytes  # the plan caches every shard in HOST
        cache = max(0, host_budget - host_others)
        if policy.device_type == "cpu":  # DEVICE is RAM too: what the gathered units leave of it
            cache += max(0, device_budget - plan.device.gathered)
        cache = min(cache, param_bytes)
    kept = sum(plan.unit_states[i] for i in plan.kept_units(host_budget))
    return StepShape(params=params, trained=trained, tokens=tokens, param_bytes=param_bytes,
                     state_bytes=plan.optimizer_states, params_on_nvme=on_nvme,
                     states_on_nvme=policy.offload_optimizer == "nvme", params_offloaded=policy.offload_params != "none"
                     and policy.device_type != "cpu", optimizer_offloaded=policy.offload_optimizer != "none",
                     cache_bytes=cache, states_in_host=kept,
                     updates_overlap=policy.overlapped or policy.speculates, checkpointing=checkpointing,
                     vertical=vertical, in_place_share=in_place_share,
                     grad_bytes=4 * (trained // world if sharded else trained))


def plan_shape(units: list[int], layout: dict, policy: StatePolicy, *, tokens: int, device_budget: int | None,
               host_budget: int | None, available: int, checkpointing: bool = False,
               vertical: bool = False) -> tuple[StepShape, int, int]:
    """The step of a model laid out as `unit_layout` gives it (`layout`: frozen units, roots, shared
    and outer modules) under `policy`, with the budgets given or derived as the engine derives them
    (ValueError where it would refuse them). Returns the step and the two budgets."""
    from outcore.runtime.memory_plan import plan_memory, unit_shapes

    frozen = layout.get("frozen") or [False] * len(units)
    plan = plan_memory(unit_shapes(units, policy, frozen=frozen, roots=layout.get("roots"),
                                   modules=layout.get("modules"), outer=layout.get("outer"),
                                   stored=layout.get("stored")), policy,
                       frozen_in_files=bool(layout.get("frozen_in_files")))
    device, host = plan.budgets(device_budget, host_budget, available)
    return (shape_of(units, frozen, plan, policy, tokens=tokens, device_budget=device, host_budget=host,
                     checkpointing=checkpointing, vertical=vertical,
                     in_place_share=in_place_share(units, layout)), device, host)


def in_place_share(units: list[int], layout: dict) -> float:
    """The share of the parameters a frozen base holds where it is read from its weights files."""
    if not layout.get("frozen_in_files") or layout.get("stored"):
        return 0.0
    frozen = layout.get("frozen") or [False] * len(units)
    return sum(n for n, f in zip(units, frozen, strict=True) if f) / max(1, sum(units))
