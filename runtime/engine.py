"""`outcore.Engine`: trains an ordinary nn.Module with ZeRO-sharded states paged through the store.

The composition, in order: plan units → lay out flat shards → size the store → materialize and
shard each unit → wire hooks. A training step is then the model's forward, `backward`, `step`:

forward   each unit is gathered in its pre-hook (prefetched from the recorded order) and, under
          ZeRO-3, released in its post-hook;
backward  a unit is gathered again when the gradient of its output arrives; when its own flat
          gradient is complete it is reduced to this rank's fp32 shard and released;
step      the global grad norm (clipping) and fp16 overflow are reduced across ranks, then each
          unit's optimizer states stream through the work tier: read → fused AdamW → write back
          (in fp32 the parameter shard is the master and is updated in place).
          With no clipping and no fp16, each unit's update already started during backward, on
          the optimizer thread, as soon as its gradient was final. Either way `step()` does not
          wait for the streamed updates: the next forward waits for each unit's own update
          before gathering it, so the update stream hides behind the next forward.
"""

from __future__ import annotations

import enum
import math
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import replace

import psutil
import torch
from torch import nn

from outcore.offload import Tier, TieredStore
from outcore.offload.background import background_pool
from outcore.runtime.checkpoint import load_checkpoint, save_checkpoint
from outcore.runtime.collectives import Group, all_reduce_sum, init_group
from outcore.runtime.config import Config
from outcore.runtime.flat_unit import Chunk, FlatUnit, Layout, UnitState
from outcore.runtime.hooks import register_grad_hook, register_unit_hooks
from outcore.runtime.host_heap import pin_mmap_threshold
from outcore.runtime.loss_scale import LossScaler
from outcore.runtime.materialize import materialize_unit
from outcore.runtime.memory_plan import HANDED_OVER, MemoryPlan, device_window, master_is_param, plan_memory
from outcore.runtime.optimizer import AdamW, ParamWriter, Placement, initial_state, update_chunks
from outcore.runtime.state_dict import export_safetensors, full_state_dict
from outcore.runtime.trace import Trace
from outcore.runtime.units import plan_units

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TIER_OF_OFFLOAD = {"none": Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.NVME}


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


def placement(config: Config) -> Placement:
    opt_tier = TIER_OF_OFFLOAD[config.offload_optimizer]
    return Placement(param_tier=TIER_OF_OFFLOAD[config.offload_params], opt_tier=opt_tier,
                     work_tier=Tier.DEVICE if opt_tier == Tier.DEVICE else Tier.HOST)


class Engine:
    """Wraps `model` for training; see SPEC.md §2 for the public contract."""

    def __init__(self, model: nn.Module, config: Config, optimizer: AdamW | None = None, *,
                 device: str | torch.device | None = None, init_fn=None, seed: int = 0) -> None:
        self.config = config
        pin_mmap_threshold()  # see runtime/host_heap.py: RSS follows the budgets, not malloc's timing
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)  # NCCL and object collectives use the current device
        self.group: Group = init_group(self.device)
        self.dtype = DTYPES[config.dtype]
        self.hp = optimizer or AdamW(**config.optimizer)
        self.lr = self.hp.lr
        self.model = model
        self.place = placement(config)
        self._work_device = self.device if self.place.work_tier == Tier.DEVICE else torch.device("cpu")
        self.scaler = LossScaler(config.dtype == "fp16")
        self.trace = Trace(config.prefetch_depth)
        # Units of the prefetch window asked onto DEVICE; on a GPU the rest waits in HOST.
        self.device_ahead = device_window(config.prefetch_depth, self.device.type)
        self.phase = Phase.IDLE
        self.global_step = 0
        self._micro = 0  # micro-steps since the last update
        self._have_grad: set[int] = set()
        self._sqnorm: dict[int, float] = {}
        self._overflow = False
        self._pending: dict[int, Future] = {}  # unit index -> its update on the optimizer thread
        # Overlapped updates given their gradient in memory (not through the store), oldest first:
        # backward waits while HANDED_OVER of them are still running, which bounds that memory.
        self._handed_over: deque[Future] = deque()
        # Units in the order their gradients were final, this step and the last: an overlapped
        # update prefetches the optimizer states of the unit expected after it.
        self._update_order: list[int] = []
        self._next_update: dict[int, int] = {}
        self._optimizer_thread = background_pool(1, "outcore-optim", config.io.nice)
        self._opt_seconds = 0.0  # time spent in optimizer updates (either path)
        self._gathered_peak = 0  # most bytes of whole-unit buffers alive at once (outside the store)
        self._state_dict_keys = list(model.state_dict(keep_vars=True).keys())

        plans = plan_units(model, config.unit_classes)
        if not plans:
            raise ValueError(f"{type(model).__name__} has no parameters to train.")
        elem = self._elem = torch.empty(0, dtype=self.dtype).element_size()
        layouts = [Layout.of(p, self.group.world, elem) for p in plans]
        self._owned_dir = None
        nvme_dir = config.nvme_dir
        if nvme_dir is None:  # nothing rests on NVMe; the store still wants a scratch directory
            nvme_dir = self._owned_dir = tempfile.mkdtemp(prefix="outcore-")
        plan = self._plan(layouts)
        device_budget, host_budget = self._budgets(plan)
        # With room in HOST for every optimizer state, writing them to NVMe and reading them back
        # each step would buy nothing: they stay in HOST once updated.
        keeps = plan.keeps_optimizer_states(host_budget, config.offload_optimizer)
        self.place = replace(self.place, write_back=not keeps)
        self.store = TieredStore(nvme_dir, self.device, device_budget, host_budget, config.io, rank=self.group.rank,
                                 prefetch_bytes=device_budget // 2)
        resident = config.stage < 3 or (self.group.world == 1 and self.place.param_tier == Tier.DEVICE)
        # One rank whose parameters rest on DEVICE: each flat buffer *is* the stored shard (one chunk).
        self._alias = self.group.world == 1 and resident and self.place.param_tier == Tier.DEVICE
        in_place = master_is_param(self.dtype == torch.float32, self.device.type, config.offload_params,
                                   config.offload_optimizer)
        self.units = [FlatUnit(p, lay, self.dtype, self.device, self.group, self.store, resident=resident,
                               chunk_elems=lay.shard if self._alias else config.sub_group_size,
                               master_is_param=in_place)
                      for p, lay in zip(plans, layouts, strict=True)]
        in_units = {m for u in self.units if u.plan.module is not model for m in u.plan.module.modules()}
        for unit in self.units:
            materialize_unit(unit.plan, model, in_units, init_fn=init_fn, seed=seed)
            self._shard(unit)
        self._move_buffers()
        self._hooks = []
        root = self.units[-1] if self.units[-1].plan.module is model else None
        for unit in self.units:
            self._hooks += register_unit_hooks(self, unit, is_root=unit is root)
            self._hooks.append(register_grad_hook(self, unit))

    # -- the training loop's API ------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        self.phase = Phase.FORWARD
        try:
            return self.model(*args, **kwargs)
        except RuntimeError as e:
            if "storage of size 0" not in str(e):
                raise
            raise RuntimeError(
                "the model read a parameter whose unit was released: a unit's parameters exist only while "
                f"its module runs. Units: {[u.name for u in self.units]}. If a parent reads a child's weight "
                "directly (say `x @ self.emb.weight.T`), tie it by registration (`head.weight = emb.weight`) "
                "or name the block classes in Config.unit_classes, which keeps other modules in the root unit."
            ) from e
        finally:
            self.phase = Phase.IDLE
            if not torch.is_grad_enabled():  # no backward will come to release the root unit
                self._reshard_all()
                self.trace.discard_step()

    def _reshard_all(self) -> None:
        for u in self.units:
            if u.state is UnitState.UNSHARDED and not u.resident:
                u.reshard()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss; gradients land, reduced, in their shards."""
        self.phase = Phase.BACKWARD
        try:
            (loss * self.scaler.scale if self.scaler.enabled else loss).backward()
        finally:
            self.phase = Phase.IDLE
        self._reshard_all()  # units that produced no gradient this time (unused) still let go
        self._micro += 1
        self.trace.end_step()

    def step(self) -> dict:
        """Apply the update at the end of an accumulation window; a no-op before it."""
        if self._micro < self.config.grad_accumulation:
            return {"grad_norm": None, "loss_scale": self.scaler.scale, "skipped": False, "lr": self.lr,
                    "accumulating": True}
        norm, coef, overflow = self._global_norm()
        skipped = overflow
        if not skipped:
            self.global_step += 1
            if not self._overlapped():
                self._start_updates(coef)
            refresh = [u for u in self.units if u.resident and not u.aliased and u.index in self._have_grad]
            if refresh:  # whole parameters kept on every rank: re-gathered here, in the same order on all
                self._wait_updates()
                for u in refresh:
                    u.refresh_resident()
        self.scaler.update(overflow)
        stats = {"grad_norm": norm, "loss_scale": self.scaler.scale, "skipped": skipped, "lr": self.lr,
                 "accumulating": False}
        self._reset_accumulation(drop_grads=skipped)  # otherwise each update drops its own
        return stats

    def synchronize(self) -> None:
        """Wait until every update `step()` started has landed. Nothing needs it for correctness
        (a unit's next gather, checkpoints and state dicts wait for what they read); it is there
        for timing a step whole, or for reading the store directly."""
        self._wait_updates()

    def save_checkpoint(self, directory: str, tag: str) -> str:
        """Sharded, checksummed, atomic; see runtime/checkpoint.py. Every rank calls it."""
        return save_checkpoint(self, directory, tag)

    def load_checkpoint(self, directory: str, tag: str | None = None) -> dict:
        """Restore exactly what `save_checkpoint` wrote (`tag=None`: the latest)."""
        return load_checkpoint(self, directory, tag)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Keys and shapes of `model.state_dict()`, trained values, on CPU; every rank calls it."""
        return full_state_dict(self)

    def export(self, path: str) -> None:
        """One consolidated safetensors file, streamed unit by unit; every rank calls it."""
        export_safetensors(self, path)

    def stats(self) -> dict:
        s = self.store.stats()
        fetches = max(1, s["fetches"])
        s.update(prefetch_hit_rate=s["hits"] / fetches, unit_wait_seconds=sum(u.wait_seconds for u in self.units),
                 optimizer_seconds=self._opt_seconds, units=len(self.units), step=self.global_step,
                 trace_divergences=self.trace.divergences,
                 gathered={"bytes": self._gathered_bytes(), "peak": self._gathered_peak})
        return s

    def close(self) -> None:
        self._wait_updates()
        self._optimizer_thread.shutdown()
        for h in self._hooks:
            h.remove()
        self.store.close()
        if self._owned_dir:
            shutil.rmtree(self._owned_dir, ignore_errors=True)

    # -- called by the hooks (runtime/hooks.py) ---------------------------------------------------

    def unit_forward_start(self, unit: FlatUnit) -> None:
        self._wait_update(unit)
        if self.phase is Phase.FORWARD:
            self._prefetch(self.trace.visit("forward", unit.index))
        unit.unshard()
        self._note_gathered()
        unit.bind_views()

    def unit_forward_end(self, unit: FlatUnit) -> None:
        if self.phase is Phase.FORWARD and not unit.resident:
            unit.reshard()  # ZeRO-3: the full parameters exist only while the unit runs

    def unit_backward_start(self, unit: FlatUnit) -> None:
        self._wait_update(unit)
        self._prefetch(self.trace.visit("backward", unit.index))
        unit.unshard()
        self._note_gathered()

    def unit_grad_ready(self, unit: FlatUnit, grads: list[torch.Tensor | None]) -> None:
        """Backward is done with the unit (`grads`: its parameters' gradients): reduce them to this
        rank's fp32 shard and accumulate it; see runtime/flat_unit.py [Note: unit gradients]."""
        world, accum = self.group.world, self.config.grad_accumulation
        first = unit.index not in self._have_grad
        last = self._micro + 1 == accum
        # One micro-step whose update starts now, where the gradient already is: the update takes
        # it as it stands, with no copy into the store and no wait for room there.
        hand_over = first and last and self._overlapped() and unit.device == self._work_device
        with torch.no_grad():
            pieces = unit.gradient_pieces(grads, 1.0 / (world * accum * self.scaler.scale), keep=hand_over)
            del grads
            self._have_grad.add(unit.index)
            sqnorm = 0.0
            for c, parts in zip(unit.chunks, pieces, strict=True):
                if first and not hand_over:
                    self._put_gradient(c, parts)
                elif not first:
                    acc = self.store.fetch(c.grad_key, self.place.work_tier).result()
                    parts = [p.to(acc.device) for p in parts]  # from a GPU to a HOST work tier
                    torch._foreach_add_(list(acc.split([p.numel() for p in parts])), parts)
                    if last:
                        sqnorm += float(torch.linalg.vector_norm(acc)) ** 2  # fp32 norms, as clip_grad_norm_
                    self.store.release(c.grad_key, dirty=True)
                if last and first:
                    sqnorm += sum(float(n) ** 2 for n in torch._foreach_norm(parts))
            if last:
                self._sqnorm[unit.index] = sqnorm
                if self.scaler.enabled and not math.isfinite(sqnorm):
                    self._overflow = True
        handed = pieces if hand_over else None
        del pieces
        if not unit.resident and unit.state is UnitState.UNSHARDED:
            unit.reshard()
        if last and self._overlapped():
            self._update_order.append(unit.index)
            following = self._next_update.get(unit.index)
            then = self.units[following].chunks if following is not None else []
            if handed is not None:
                while self._handed_over and (self._handed_over[0].done() or len(self._handed_over) >= HANDED_OVER):
                    self._handed_over.popleft().result()
            future = self._optimizer_thread.submit(self._update, unit, self.lr, 1.0, then, handed)
            self._pending[unit.index] = future
            if handed is not None:
                self._handed_over.append(future)

    # -- internals --------------------------------------------------------------------------------

    def _put_gradient(self, chunk: Chunk, parts: list[torch.Tensor]) -> None:
        """A chunk's first gradient into the store's work tier: its pieces concatenated straight into
        the store's buffer where they share its device, else through `put`'s copy."""
        tier = self.place.work_tier
        if len(parts) == 1 or parts[0].device != self._work_device:
            self.store.put(chunk.grad_key, parts[0] if len(parts) == 1 else torch.cat(parts), tier)
            return
        staged = self.store.stage(chunk.grad_key, (chunk.numel,), torch.float32, tier)
        try:
            torch.cat(parts, out=staged.tensor)
        except BaseException as e:
            staged.abort(e)
            raise
        staged.commit()

    def _gathered_bytes(self) -> int:
        return sum(u.flat.untyped_storage().nbytes() for u in self.units  # borrowed ones are in the store
                   if u.state is UnitState.UNSHARDED and not u.aliased and not u.borrowed)

    def _note_gathered(self) -> None:
        self._gathered_peak = max(self._gathered_peak, self._gathered_bytes())

    def _prefetch(self, unit_indices: list[int]) -> None:
        """Start bringing the parameter shards of the units expected next (`prefetch_depth` of them)
        closer: the nearest `device_ahead` onto the device, the rest from NVMe into HOST
        (`outcore.runtime.memory_plan.device_window`; DESIGN.md's two levels)."""
        # A unit still being updated is skipped: its update brings its shard into memory itself.
        # (A finished update stays in `_pending` until the unit is next gathered: not skipped.)
        keys = [self.units[i].param_key for i in unit_indices if not self._updating(i)
                and not self.units[i].resident and self.units[i].state is UnitState.SHARDED]
        if keys:
            self.store.prefetch(keys[: self.device_ahead], Tier.DEVICE)
            if self.place.param_tier == Tier.NVME and len(keys) > self.device_ahead:
                self.store.prefetch(keys[self.device_ahead :], Tier.HOST)

    def _reset_accumulation(self, *, drop_grads: bool) -> None:
        """End an accumulation window. `drop_grads`: no update will spend its gradients (a skipped
        step, or a window a checkpoint load abandons), so drop them here, never written back."""
        for u in self.units:
            if drop_grads and u.index in self._have_grad:
                for c in u.chunks:
                    if c.grad_key in self.store:
                        self.store.delete(c.grad_key)
        self._micro = 0
        if self._update_order:
            order = self._update_order
            self._next_update = dict(zip(order, order[1:], strict=False))
            self._update_order = []
        self._have_grad.clear()
        self._sqnorm.clear()
        self._overflow = False

    def _overlapped(self) -> bool:
        """Updates may run during backward: nothing needs every gradient first."""
        return self.config.grad_clip is None and not self.scaler.enabled

    def _update(self, unit: FlatUnit, lr: float, coef: float, then: list,
                grad: list[list[torch.Tensor]] | None) -> None:
        """One unit's update on the optimizer thread, while backward goes on; the states of `then`
        (the next unit's chunks, expected from the last step's order) are prefetched as it ends."""
        t0 = time.perf_counter()
        self._stream_updates(unit.chunks, lr, coef, then, grad=grad)
        self._opt_seconds += time.perf_counter() - t0

    def _start_updates(self, coef: float) -> None:
        """After backward (clipping or fp16): every unit with a gradient, in the order the next
        forward wants them. States in the work tier take one fused call, here; streamed ones go to
        the optimizer thread, and each unit's future completes as its last chunk is written."""
        forward = self.trace.recorded.get("forward", [])
        rank = {index: pos for pos, index in enumerate(forward)}
        units = sorted((u for u in self.units if u.index in self._have_grad),
                       key=lambda u: rank.get(u.index, len(rank)))
        if self.place.opt_tier == self.place.work_tier:  # nothing to stream: one fused call
            t0 = time.perf_counter()
            with ParamWriter(self.store, self.place) as params:
                update_chunks([c for u in units for c in u.chunks], self.store, self.place, self.hp, params,
                              lr=self.lr, grad_scale=coef)
            for u in units:
                u.opt_steps += 1
            self._opt_seconds += time.perf_counter() - t0
            return
        futures = {u.index: Future() for u in units}
        self._pending.update(futures)
        lr = self.lr  # the loop may set the next step's before these have run

        def run() -> None:
            t0 = time.perf_counter()
            try:
                self._stream_updates([c for u in units for c in u.chunks], lr, coef, finished=futures)
            except BaseException as e:
                for f in futures.values():
                    if not f.done():
                        f.set_exception(e)
                raise
            finally:
                self._opt_seconds += time.perf_counter() - t0

        self._optimizer_thread.submit(run)

    def _stream_updates(self, order: list, lr: float, coef: float, then: Sequence = (),
                        finished: dict | None = None, grad: list[list[torch.Tensor]] | None = None) -> None:
        """Chunk by chunk, with the next `prefetch_depth` chunks' states on their way to the work tier
        (past the end of `order`, the optimizer states of the chunks in `then`). Each unit's step
        count advances as its last chunk is done, and then its future in `finished` (if given) completes.
        `grad`: one unit's gradient handed over in memory, per chunk (its chunks read no grad keys)."""
        depth = max(1, self.config.prefetch_depth)
        streaming = self.place.opt_tier != self.place.work_tier
        with ParamWriter(self.store, self.place) as params:
            for i, chunk in enumerate(order):
                if streaming:
                    ahead = order[i + 1 : i + 1 + depth]
                    keys = []
                    for c in ahead:
                        keys += [*self._master_keys(c), c.opt_key] + ([c.grad_key] if grad is None else [])
                    keys += [c.opt_key for c in then[: max(0, i + 1 + depth - len(order))]]
                    self.store.prefetch(keys, self.place.work_tier)
                update_chunks([chunk], self.store, self.place, self.hp, params, lr=lr, grad_scale=coef,
                              grads=None if grad is None else [grad[chunk.index]])
                if chunk is chunk.unit.chunks[-1]:
                    chunk.unit.opt_steps += 1
                    if finished is not None:
                        finished[chunk.unit.index].set_result(None)

    def _master_keys(self, chunk) -> tuple[str, ...]:
        """The store key a chunk's update needs besides its own: its unit's parameter shard, when
        that is the master (asked for once, with the unit's first chunk) and not in usable memory."""
        unit = chunk.unit
        if chunk.index != 0 or not unit.master_is_param or unit.aliased:
            return ()
        return (unit.param_key,) if self.store.ram_tier_of(unit.param_key) is None else ()

    def _updating(self, index: int) -> bool:
        future = self._pending.get(index)
        return future is not None and not future.done()

    def _wait_update(self, unit: FlatUnit) -> None:
        """Before a unit is gathered again: its update, if one is still running, has finished."""
        future = self._pending.pop(unit.index, None)
        if future is not None:
            future.result()

    def _wait_updates(self) -> None:
        pending, self._pending = self._pending, {}
        for f in pending.values():
            f.result()

    def _global_norm(self) -> tuple[float | None, float, bool]:
        """Gradient norm over all shards and ranks, the clip coefficient, and fp16 overflow."""
        total = torch.tensor([sum(self._sqnorm.values()), float(self._overflow)], dtype=torch.float64,
                             device=self.device)  # NCCL reduces device tensors only
        all_reduce_sum(total, self.group)
        overflow = bool(total[1] > 0) or not math.isfinite(float(total[0]))
        norm = math.sqrt(float(total[0])) if not overflow else float("inf")
        coef = 1.0
        if self.config.grad_clip is not None and not overflow:
            coef = min(1.0, self.config.grad_clip / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
        return norm, coef, overflow

    def _shard(self, unit: FlatUnit) -> None:
        """Flatten the unit's (materialized) parameters, keep this rank's shard, drop the originals."""
        lay, rank = unit.layout, self.group.rank
        flat32 = torch.zeros(lay.padded, dtype=torch.float32)
        for slot, off in zip(unit.plan.slots, lay.offsets, strict=True):
            module, name = slot.places[0]
            flat32[off : off + slot.numel].copy_(module._parameters[name].detach().reshape(-1))
        master = flat32[rank * lay.shard : (rank + 1) * lay.shard]
        for c in unit.chunks:
            state = initial_state(master[c.start : c.end], with_master=not unit.master_is_param)
            self.store.put(c.opt_key, state, self.place.opt_tier)
        self.store.put(unit.param_key, master, self.place.param_tier, dtype=self.dtype)
        del flat32, master
        for slot in unit.plan.slots:
            for module, name in slot.places:
                del module._parameters[name]  # the flat buffer's views take their place
            slot.param = None
        if unit.resident:
            if self._alias:
                unit.alias_shard()
            else:
                unit.unshard()
            unit.bind_views()

    def _move_buffers(self) -> None:
        for module in self.model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.device != self.device:
                    module._buffers[name] = buf.to(self.device)

    def memory_plan(self) -> MemoryPlan:
        """Per-tier bytes of this rank (runtime/memory_plan.py): what the budgets are derived from."""
        return self._plan([u.layout for u in self.units])

    def _plan(self, layouts: list[Layout]) -> MemoryPlan:
        c = self.config
        return plan_memory([lay.shard for lay in layouts], [lay.padded for lay in layouts], elem=self._elem,
                           world=self.group.world, stage=c.stage, offload_params=c.offload_params,
                           offload_optimizer=c.offload_optimizer, prefetch_depth=c.prefetch_depth,
                           sub_group_size=c.sub_group_size, fp32=self.dtype == torch.float32,
                           overlapped=self._overlapped(), device_type=self.device.type,
                           grad_accumulation=c.grad_accumulation)

    def _budgets(self, plan: MemoryPlan) -> tuple[int, int]:
        """Budgets from the config, or derived from the memory plan and the machine; checked against
        the smallest working set, so that a budget too small fails here with the number that works."""
        c = self.config
        dev = plan.device.states + plan.device.runtime
        host = plan.host.states + plan.host.runtime
        device_budget = c.device_budget or max(dev, plan.device_min)
        host_budget = c.host_budget or max(plan.host_min, min(host, psutil.virtual_memory().available // 2))
        if device_budget < plan.device_min:
            raise ValueError(f"device_budget={device_budget:,} bytes cannot hold what must stay on the device "
                             f"({plan.device_min:,} bytes for this model and offload setting); raise it or offload "
                             "more.")
        if host_budget < plan.host_min:
            raise ValueError(f"host_budget={host_budget:,} bytes cannot hold the optimizer's working set "
                             f"({plan.host_min:,} bytes); raise it to at least that, or lower sub_group_size.")
        return device_budget, max(host_budget, 4096)
