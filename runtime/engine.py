"""`outcore.Engine`: trains an ordinary nn.Module with ZeRO-sharded states paged through the store.

This file composes the parts and holds the public API; each part is a module of its own: the start
(runtime/engine_start.py), a micro-step's passes and the hooks' target (runtime/unit_lifecycle.py),
a train_batch's turns (runtime/vertical.py), the gradient path (runtime/gradient_path.py) and the
update stream (runtime/update_stream.py). The start, in order: plan units, lay out flat shards,
size the store, materialize and shard each unit, wire hooks.

forward   each unit is gathered in its pre-hook (prefetched from the recorded order) and, under
          ZeRO-3, released in its post-hook;
backward  a unit is gathered again when the gradient of its output arrives; when its flat gradient
          is complete it is reduced to this rank's fp32 shard and released;
step      the global grad norm and fp16 overflow are reduced across ranks, then each unit's states
          stream through the work tier: read, fused AdamW, write back (in fp32 the parameter shard
          is the master, updated in place). Without clipping or fp16 a unit's update starts during
          backward, as soon as its gradient is final. `step()` does not wait for the stream: the
          next forward waits for each unit's own update before gathering it.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from outcore.offload import Tier
from outcore.offload.exit_close import close_at_exit, forget
from outcore.runtime import engine_start as start
from outcore.runtime.activation_paging import ActivationPaging, free_memory
from outcore.runtime.checkpoint.base_files import base_files
from outcore.runtime.checkpoint.sharded import load_checkpoint, save_checkpoint
from outcore.runtime.checkpoint.sharded_model import ShardedModel
from outcore.runtime.checkpoint.state_dict import export_model, full_state_dict
from outcore.runtime.collectives import Group, init_group, rank_device
from outcore.runtime.config import Config
from outcore.runtime.flat_unit import FlatUnit, Layout
from outcore.runtime.gradient_path import GradientPath
from outcore.runtime.hooks import register_hooks
from outcore.runtime.loss_scale import LossScaler
from outcore.runtime.lr_schedule import LearningRate, Schedule, SchedulerFactory
from outcore.runtime.memory_plan import MemoryPlan, plan_memory
from outcore.runtime.model_family import family_of
from outcore.runtime.optimizer import AdamW
from outcore.runtime.policy import StatePolicy
from outcore.runtime.pretrained import PretrainedWeights
from outcore.runtime.quantized_base import as_stored, quantized_plans
from outcore.runtime.random_draws import RandomDraws
from outcore.runtime.stochastic_rounding import StochasticRounding
from outcore.runtime.trace import Trace
from outcore.runtime.unit_lifecycle import UnitLifecycle
from outcore.runtime.units import plan_units
from outcore.runtime.update_stream import UpdateStream
from outcore.runtime.vertical import VerticalBatch, micro_batch_count, views_gathered_unit

log = logging.getLogger(__name__)


def _engine_call(method: Callable[..., Any]) -> Callable[..., Any]:
    """An engine API call: refused, saying so, after `close()`; else it first ends the micro-step of
    a plain `loss.backward()` the caller ran before it (`UnitLifecycle.engine_called`)."""
    @functools.wraps(method)
    def call(self: Engine, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError(f"Engine.{method.__name__}: this engine was closed, and its parameters and "
                               "optimizer states went with its store; build a new Engine (load_checkpoint "
                               "restores a saved run into it).")
        self.lifecycle.engine_called(without_grad=method.__name__ == "__call__" and not torch.is_grad_enabled())
        return method(self, *args, **kwargs)
    return call


class Engine:
    """Wraps `model` for training; the README's Python API section is the contract."""

    def __init__(self, model: nn.Module, config: Config, optimizer: AdamW | None = None, *,
                 device: str | torch.device | None = None, init_fn: Callable[[nn.Module], None] | None = None,
                 seed: int = 0, weights: str | os.PathLike | None = None,
                 lr_scheduler: SchedulerFactory | None = None) -> None:
        start.check_arguments(model, config, optimizer, seed)
        self.config, self.model = config, model
        self.device = rank_device(device)
        self.group: Group = init_group(self.device, config.collective_timeout)
        self.policy = StatePolicy.of(config, world=self.group.world, device_type=self.device.type)
        self.hp = optimizer or AdamW(**config.optimizer)
        self.schedule = Schedule(self.hp.lr, lr_scheduler)  # runtime/lr_schedule.py
        self.scaler = LossScaler(config.dtype == "fp16")
        self.trace = Trace(config.prefetch_depth)
        self.global_step = 0
        state_dict_keys = list(model.state_dict(keep_vars=True).keys())

        self.family = family_of(model)  # what the engine asks of the model beyond nn.Module
        self.family.check()
        self.family.split_sequence(config.loss_chunk_tokens, config.tile_tokens, free_memory(self.device))
        plans = plan_units(model, config.unit_classes, in_root=self.family.read_outside_forward())
        if not plans:
            raise ValueError(f"{type(model).__name__} has no parameters to train.")
        pretrained = start.check_pretrained(None if weights is None else os.fspath(weights), self.family, plans)
        layouts = [Layout.of(p, self.group.world, self.policy.elem) for p in plans]
        # frozen units stored quantized: runtime/quantized.py [Note: quantized frozen units]
        config = self.config = as_stored(config, pretrained)
        self._quantized = quantized_plans(plans, config, pretrained, self.family.kept_whole(), self.policy.torch_dtype,
                                          self.group.world)
        self.store, self.place, read_ahead, self._owned_dir = start.open_store(
            config, self.policy, self.device, self.group.rank, start.shapes_of(plans, self.policy, self._quantized),
            frozen_in_files=pretrained is not None)
        self.units = [FlatUnit(p, lay, self.policy, self.device, self.group, self.store)
                      for p, lay in zip(plans, layouts, strict=True)]
        for unit, quantized in zip(self.units, self._quantized, strict=True):
            if quantized is not None:
                unit.store_quantized(quantized)
        rounding = StochasticRounding(seed + self.group.rank) if self.policy.state_dtype == "bf16" else None
        self.updates = UpdateStream(self.units, self.store, self.place, self.hp,
                                    read_ahead=read_ahead, nice=config.io.nice, rounding=rounding)
        work_device = self.device if self.place.work_tier == Tier.DEVICE else torch.device("cpu")
        self.gradients = GradientPath(self.store, self.policy, self.place, self.group, self.scaler, self.updates,
                                      device=self.device, work_device=work_device)
        self.sharded = ShardedModel(model, self.units, self.store, self.place, self.group, self.updates,
                                    state_dict_keys, self.family,
                                    base=None if pretrained is None else base_files(pretrained.path, pretrained.stamps))
        if self.sharded.base is not None and self.group.rank == 0:
            self.sharded.base.remember()  # the bytes each save's record is checked against
        self.lifecycle = UnitLifecycle(self.units, self.store, self.place, self.policy, self.trace, self.updates,
                                       self.gradients, self.sharded, self.scaler, self.schedule, self.group,
                                       self.device)
        self._random_draws = RandomDraws(self.device)
        self.activations = ActivationPaging(config, self.store, self.device,
                                            is_parameter=functools.partial(views_gathered_unit, self.units))
        self._hooks: list[Any] = []
        self._closed = False
        # Keys the config keeps in memory went to NVMe once the host budget was full: said once.
        self._spill_said = "nvme" in (config.offload_params, config.offload_optimizer)
        self._exit_token = close_at_exit(self)  # closed before the interpreter stops its threads
        self._start(init_fn, seed, pretrained)

    def train(self, mode: bool = True) -> Engine:
        """The model's `train(mode)`, as on a DeepSpeed engine or a module: dropout and friends."""
        self.model.train(mode)
        return self

    def eval(self) -> Engine:
        """The model's `eval()`."""
        return self.train(False)

    @property
    def module(self) -> nn.Module:
        """The wrapped model. Called directly (under `torch.no_grad()`, or its `generate()`), it
        fetches each unit as it runs and lets it go after, as in training."""
        return self.model

    # -- the training loop's API ------------------------------------------------------------------

    @property
    def lr(self) -> float:
        """The learning rate of the next `step()`; settable between steps (a schedule by hand)."""
        return self.schedule.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.schedule.lr = value

    @property
    def optimizer(self) -> LearningRate:
        """A torch optimizer of one parameter group, `{"lr": ...}`, for a torch LR scheduler to drive
        (`lr_scheduler=` builds one on it and the engine steps it)."""
        return self.schedule.optimizer

    @property
    def lr_scheduler(self) -> LRScheduler | None:
        """The LR scheduler the engine steps after each update it applies, or None."""
        return self.schedule.scheduler

    def use_lr_scheduler(self, factory: SchedulerFactory) -> LRScheduler:
        """Build an LR scheduler on `engine.optimizer` and step it from now on, as `lr_scheduler=`
        does from the start: for a caller that knows the run's length only when it trains (a
        Trainer). Returns the scheduler."""
        if self.schedule.scheduler is not None:
            raise ValueError("this engine already steps an LR scheduler; one engine drives one schedule.")
        return self.schedule.attach(factory)

    @_engine_call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self.schedule.check()  # backward may start updates at this rate: refused now, not halfway
        with self.activations.forward(self.model):
            return self.lifecycle.forward(self.model, args, kwargs)

    @_engine_call
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss; gradients land, reduced, in their shards. A plain
        `loss.backward()` does the same, but in fp16, where only this scales the loss."""
        self.updates.check()
        self.lifecycle.backward(loss)

    @_engine_call
    def train_batch(self, micro_batches: Sequence[Any],
                    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, *,
                    compute_loss: Callable[[Any], torch.Tensor] | None = None) -> dict[str, Any]:
        """K micro-batches as one optimizer step, each unit gathered once in forward and once in
        backward for all K (runtime/vertical.py [Note: vertical schedule]). Each micro-batch is a
        tuple of forward arguments, a dict of keyword arguments or one tensor; the model returns
        the loss (or an object with `.loss`), or `loss_fn(output, micro_batch)` does. Or
        `compute_loss(micro_batch)` calls the model itself, once, and returns the loss (a trainer's
        own loss, hf/trainer.py). The result equals K forward/backward calls and a step with
        `grad_accumulation=K` (for a model that draws no random numbers: [Note: random draws]).
        Returns `step()`'s stats plus "losses" (K floats)."""
        count = micro_batch_count(micro_batches)
        if self.gradients.micro:
            raise ValueError("train_batch was called inside an accumulation window of backward() calls; "
                             "finish it with step() first.")
        if compute_loss is not None and loss_fn is not None:
            raise ValueError("train_batch: give loss_fn (the model's output to a loss) or compute_loss (a micro-batch "
                             "to a loss, calling the model itself), not both.")
        saved = self.activations.for_batch()

        # once each: a module with frozen parameters is two units (the trainable and its frozen sibling)
        blocks = list({id(u.plan.module): u.plan.module for u in self.units
                       if u.plan.module is not self.model}.values())
        batch = VerticalBatch(count, shared_views=self.policy.dtype == "fp32")
        losses = batch.run(micro_batches, loss_fn, compute_loss, lifecycle=self.lifecycle, model=self.model,
                           blocks=blocks, saved=saved, random_draws=self._random_draws)
        stats = self.step()
        stats["losses"] = [float(loss.detach()) for loss in losses]
        return stats

    @_engine_call
    def step(self) -> dict[str, Any]:
        """Apply the update at the end of an accumulation window; a no-op before it."""
        self.updates.check()
        if not self.gradients.window_complete:
            return {"grad_norm": None, "loss_scale": self.scaler.scale, "skipped": False, "lr": self.lr,
                    "accumulating": True}
        late = self.gradients.finish_window(self.units)
        self.activations.step_done()
        norm, coef, overflow = self.gradients.global_norm(self.config.grad_clip)
        lr = self.lr
        speculated = self.updates.speculated_units()
        if overflow and speculated and not self.updates.take_back(sorted(speculated)):
            # skipped, but the updates that ran beside backward cannot be taken back exactly
            self.gradients.reset(self.units, drop_grads=True)
            self.updates.halt("a step whose gradient norm was not finite came after updates had run beside backward "
                              "that cannot be taken back exactly (clipping, speculated). Call "
                              "engine.load_checkpoint() to go on from a saved state.")
            self.updates.check()
        if not overflow:
            self.global_step += 1
            with_gradient = [u for u in self.units if u.index in self.gradients.with_gradient]
            if speculated:  # they stand, or are done again clipped: [Note: speculative clipping]
                self.updates.settle_speculation(coef)
            # overlapped: the rest started in backward; speculated: those stand or are redone
            waiting = late if self.policy.overlapped else [u for u in with_gradient if u.index not in speculated]
            if waiting:
                forward = {index: pos for pos, index in enumerate(self.trace.recorded.get("forward", []))}
                # the order the next forward wants them
                in_order = sorted(waiting, key=lambda u: forward.get(u.index, len(forward)))
                kept = self.gradients.kept if self.policy.step_in_memory else None
                self.updates.start(in_order, lr, coef, kept, self.gradients.idle)
            refresh = [u for u in with_gradient if u.resident and not u.aliased]
            if refresh:  # whole parameters kept on every rank: re-gathered here, in the same order on all
                self.updates.drain()
                for u in refresh:
                    u.refresh()
        self.scaler.update(overflow)
        stats = {"grad_norm": norm, "loss_scale": self.scaler.scale, "skipped": overflow, "lr": lr,
                 "accumulating": False}
        self.gradients.reset(self.units, drop_grads=overflow)  # otherwise each update drops its own
        self.gradients.speculating = self.policy.speculates and coef == 1.0
        if not overflow:
            self.schedule.applied()  # the scheduler's next rate, as DeepSpeed steps it after an update
        if not self._spill_said and self.store.bytes_swapped_out:  # even if read back since
            self._spill_said = True
            what = ("raise host_budget, or leave it unset to size it from the memory plan" if self.config.host_budget
                    else "the budget was derived with at most half the free memory: set host_budget above it")
            log.warning("the host budget (%s bytes) could not hold what this config keeps in memory: %s bytes of "
                        "it went to the swap file (nvme_dir, or a scratch folder where that is unset) and are "
                        "read back when needed, which is slower; %s", f"{self.store.stats()['host']['budget']:,}",
                        f"{self.store.bytes_swapped_out:,}", what)
        return stats

    def synchronize(self) -> None:
        """Wait until every update `step()` started has landed. Nothing needs it for correctness
        (a unit's next gather, checkpoints and state dicts wait for what they read); it is there
        for timing a step whole, or for reading the store directly."""
        self.updates.drain()

    @_engine_call
    def save_checkpoint(self, directory: str, tag: str | None = None,
                        client_state: dict[str, Any] | None = None) -> str:
        """Sharded, checksummed, atomic; see runtime/checkpoint/sharded.py. Every rank calls it. `tag`:
        the folder's name (None: `global_step<N>`, as DeepSpeed names it). `client_state`: the
        caller's own JSON values (epoch, data position), rank 0's kept and given back by
        `load_checkpoint` as its "client_state". Returns the folder."""
        if self.gradients.micro:
            spent = self.policy.overlapped and self.gradients.window_complete
            raise RuntimeError(f"save_checkpoint after {self.gradients.micro} backward pass(es) and before their "
                               "step(): a checkpoint holds no gradients, so a run resumed from it would lose them"
                               + (" (and their updates already ran)" if spent else "")
                               + ". Call engine.step() first, then save.")
        tag = f"global_step{self.global_step}" if tag is None else tag
        progress = {"step": self.global_step, "lr": self.lr, "lr_scheduler": self.schedule.state_dict(),
                    "loss_scale": self.scaler.state_dict(), "speculating": self.gradients.speculating,
                    "config": self.config.to_dict(), "client_state": client_state,
                    "model_record": self.family.checkpoint_record(self.sharded.state_dict_keys)}
        return save_checkpoint(self.sharded, directory, tag, progress)

    @_engine_call
    def load_checkpoint(self, directory: str, tag: str | None = None) -> dict[str, Any]:
        """Restore exactly what `save_checkpoint` wrote (`tag=None`: the latest). After a failed
        update or pass this also mends the engine; units a failure left gathered let go first."""
        self.lifecycle.reshard_all()
        meta = load_checkpoint(self.sharded, directory, tag)
        self.global_step = int(meta["step"])
        self.lr = float(meta["lr"])
        self.schedule.load_state_dict(meta.get("lr_scheduler"))
        self.scaler.load_state_dict(meta["loss_scale"])
        self.gradients.reset(self.units, drop_grads=True)
        # the next step takes the path the saved run's would have (the redo of a clipped speculation
        # differs from a clipped update in the last bits): [Note: speculative clipping]
        self.gradients.speculating = self.policy.speculates and meta.get("speculating", True) is not False
        return meta

    @_engine_call
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Keys and shapes of `model.state_dict()`, trained values, on CPU; every rank calls it."""
        return full_state_dict(self.sharded)

    @_engine_call
    def export(self, path: str | os.PathLike, *, adapters_only: bool = False, merge_adapters: bool = False,
               max_shard_size: int = 5_000_000_000) -> None:
        """Streamed unit by unit; every rank calls it. `path` ending in `.safetensors`: one file of
        every tensor. Otherwise a Hugging Face directory that `from_pretrained` loads: shards of at
        most `max_shard_size` bytes, their index, and config.json when the model carries an HF
        config. For a peft model, `adapters_only`: its adapters, for `PeftModel.from_pretrained`;
        `merge_adapters`: its base model with the adapters merged in, as `merge_and_unload()` gives."""
        export_model(self.sharded, os.fspath(path), adapters_only=adapters_only,
                     merge_adapters=merge_adapters, max_shard_size=max_shard_size)

    def stats(self) -> dict[str, Any]:
        s = self.store.stats()
        fetches = max(1, s["fetches"])
        s.update(prefetch_hit_rate=s["hits"] / fetches, unit_wait_seconds=sum(u.wait_seconds for u in self.units),
                 optimizer_seconds=self.updates.seconds, units=len(self.units), step=self.global_step,
                 speculative_updates=dict(self.updates.speculated),
                 trace_divergences=self.trace.divergences, activations=dict(self.activations.last_step),
                 gathered={"bytes": self.lifecycle.gathered_bytes(), "peak": self.lifecycle.gathered_peak})
        return s

    def memory_plan(self) -> MemoryPlan:
        """Per-tier bytes of this rank (runtime/memory_plan.py): what the budgets are derived from."""
        plan = plan_memory(start.shapes_of([u.plan for u in self.units], self.policy, self._quantized), self.policy,
                           frozen_in_files=any(u.in_place is not None for u in self.units))
        return plan.placed(self.place.kept)

    def close(self) -> None:
        self._closed = True
        forget(self._exit_token)
        try:
            self.lifecycle.engine_called(without_grad=False)
            self.updates.close()  # an update's error not raised before is raised, after the rest
        finally:
            for h in self._hooks:
                h.remove()
            for unit in self.units:
                unit.mark_closed()
            try:
                self.sharded.writer_lock.release()
            finally:
                try:
                    self.store.close()  # whatever the lock's release met
                finally:
                    if self._owned_dir is not None:
                        self._owned_dir.remove()

    # -- internals --------------------------------------------------------------------------------

    def _start(self, init_fn: Callable[[nn.Module], None] | None, seed: int,
               pretrained: PretrainedWeights | None) -> None:
        """Materialize every unit into the store, then wire the hooks. A start that fails leaves no
        swap file filling the disk."""
        try:
            start.lay_out_states(self.family, self.units, self.store, self.place, self.policy, self.device,
                           self.group.rank, init_fn=init_fn, seed=seed, pretrained=pretrained)
        except BaseException:
            start.close_failed_start(self.close, self.config.nvme_dir)
            raise
        self.sharded.anchor(self.device, self.policy.torch_dtype)
        self.sharded.guard_state_dict()
        self._hooks = register_hooks(self.lifecycle, self.units, self.model)
