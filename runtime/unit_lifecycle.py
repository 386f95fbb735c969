"""The hook side of a step: each unit gathered, used and let go as forward and backward reach it.

`Engine` runs the public loop; the hooks (runtime/hooks.py) call into a `UnitLifecycle`, which
knows the training phase, gathers each unit (prefetching the next ones from the recorded order),
binds its views and releases it, and passes each finished gradient to the gradient path. How many
times a unit runs before it may go is the schedule's to say: one micro-batch at a time
(`OneMicroBatch`), or the K micro-batches of a train_batch (runtime/vertical.py's
`VerticalBatch`), which the lifecycle consults the same way and never branches on.

The phase moves only along named transitions, each asserting where it starts:

    IDLE --begin_forward--> FORWARD --end--> IDLE
    IDLE --begin_backward--> BACKWARD --end--> IDLE          engine.backward(loss)
    FORWARD --begin_backward--> BACKWARD                        a train_batch's one backward
    IDLE --begin_plain_backward--> PLAIN_BACKWARD --end--> IDLE a caller's loss.backward(),
                                                                ended at the engine's next call
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Protocol

import torch
from torch import nn

from outcore.offload import Tier, TieredStore
from outcore.runtime.backward_watch import BackwardWatch
from outcore.runtime.checkpoint.sharded_model import ShardedModel
from outcore.runtime.collectives import Group, give_up_group
from outcore.runtime.flat_unit import FlatUnit, UnitState
from outcore.runtime.forward_cycle import ForwardCycle
from outcore.runtime.gradient_path import GradientPath, Undone
from outcore.runtime.hooks import refuse_a_second_backward
from outcore.runtime.loss_scale import LossScaler
from outcore.runtime.lr_schedule import Schedule
from outcore.runtime.policy import Placement, StatePolicy
from outcore.runtime.trace import Trace
from outcore.runtime.update_stream import UpdateStream

log = logging.getLogger("outcore.runtime.engine")  # the engine's log, as a user configures it


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"  # engine.backward() or a train_batch's
    PLAIN_BACKWARD = "plain backward"  # a loss.backward() the engine has not ended yet

    @property
    def backward(self) -> bool:
        return self in (Phase.BACKWARD, Phase.PLAIN_BACKWARD)


class TrainingPhase:
    """The phase, moved only by its named transitions."""

    def __init__(self) -> None:
        self.now = Phase.IDLE

    def _move(self, to: Phase, *starts: Phase) -> None:
        if self.now not in starts:
            raise RuntimeError(f"outcore: the engine went from {self.now.value} to {to.value}, which it never does; "
                               "this is a bug in outcore, please report it with the traceback.")
        self.now = to

    def begin_forward(self) -> None:
        self._move(Phase.FORWARD, Phase.IDLE)

    def begin_backward(self) -> None:
        self._move(Phase.BACKWARD, Phase.IDLE, Phase.FORWARD)

    def begin_plain_backward(self) -> None:
        self._move(Phase.PLAIN_BACKWARD, Phase.IDLE)

    def end(self) -> None:
        """Back to IDLE from wherever the phase is: the end of a call, or of a failed one."""
        self.now = Phase.IDLE


class MicroBatchSchedule(Protocol):
    """How the micro-batches of a step share each unit (what the lifecycle asks of a schedule)."""

    def unit_entered(self, unit: FlatUnit) -> None:
        """Forward reaches `unit`, before it is gathered."""

    def needs_views(self, unit: FlatUnit) -> bool:
        """Whether `unit`'s views are to be bound for this run of it."""

    def views_bound(self, unit: FlatUnit, views: list[torch.Tensor]) -> None:
        """`views` were bound for this run of `unit`."""

    def holds(self, moment: str, unit: FlatUnit) -> bool:
        """After `moment` ("forward" or "backward") of `unit`: whether it stays gathered for
        another micro-batch's."""


class OneMicroBatch:
    """The plain schedule: each micro-batch a forward and a backward of its own."""

    def unit_entered(self, unit: FlatUnit) -> None:
        pass

    def needs_views(self, unit: FlatUnit) -> bool:
        return True

    def views_bound(self, unit: FlatUnit, views: list[torch.Tensor]) -> None:
        pass

    def holds(self, moment: str, unit: FlatUnit) -> bool:
        return False


class UnitLifecycle:
    """The hooks' target (runtime/hooks.py `UnitHookTarget`) and the training phase."""

    def __init__(self, units: list[FlatUnit], store: TieredStore, place: Placement, policy: StatePolicy,
                 trace: Trace, updates: UpdateStream, gradients: GradientPath, sharded: ShardedModel,
                 scaler: LossScaler, schedule: Schedule, group: Group, device: torch.device) -> None:
        self.units, self.store, self.place, self.policy = units, store, place, policy
        self.trace, self.updates, self.gradients, self.sharded = trace, updates, gradients, sharded
        self.scaler, self.lr_schedule, self.group, self.device = scaler, schedule, group, device
        self.phase = TrainingPhase()
        self.schedule: MicroBatchSchedule = OneMicroBatch()  # a train_batch's while one runs
        self.watch = BackwardWatch()  # whether a plain backward finished or raised
        self.device_ahead = policy.device_window  # units of the prefetch window asked onto DEVICE
        self.cycle = ForwardCycle(units, store, world=group.world, device_ahead=self.device_ahead,
                                  prefetch_depth=policy.prefetch_depth, params_on_nvme=place.param_tier == Tier.NVME)
        self.gathered_peak = 0  # most bytes of whole-unit buffers alive at once (outside the store)

    # -- a micro-step's passes -------------------------------------------------------------------

    def forward(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The model's forward, its units gathered and let go by the hooks. One that raised (a bad
        batch, an out-of-memory, Ctrl-C) will see no backward, no more than one under no_grad: the
        units it gathered are let go and its half-recorded order dropped, so that a save, an export
        or the next step finds the engine as before it (SPEC: a failed micro-step)."""
        self.phase.begin_forward()
        failed = False
        runs_before = dict(self.gradients.backward_pass.runs)
        try:
            output = model(*args, **kwargs)
            if torch.is_grad_enabled():
                if not self.policy.resident or self.policy.overlapped:
                    refuse_a_second_backward(output)
                self.watch.arm(output)  # after: a second backward refused there never starts a pass
            return output
        except BaseException:
            failed = True
            raise
        finally:
            self.phase.end()
            if failed or not torch.is_grad_enabled():  # no backward will come to release the units
                self.reshard_all(keep_cycle=not failed)
                self.trace.discard_step()
            if failed:
                self.gradients.forward_failed(runs_before)

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward (its loss scaled in fp16), then the micro-step's end; one that
        raised is abandoned ([Note: a failed micro-step])."""
        self.refuse_a_full_window()
        self.phase.begin_backward()
        try:
            (loss * self.scaler.scale if self.scaler.enabled else loss).backward()
        except BaseException as error:
            self.abandon_micro_step(error)
            raise
        finally:
            self.phase.end()
        self.watch.forget()
        self.end_micro_step()

    # -- the hooks' calls ------------------------------------------------------------------------

    def unit_forward_start(self, unit: FlatUnit) -> None:
        self.sharded.check_unconverted(self.device, self.policy.torch_dtype)
        cycling = not torch.is_grad_enabled() and not self.phase.now.backward
        if not cycling:
            self.cycle.end()
        elif self.cycle.holds(unit):
            return  # gathered, its views bound, for a cycle of passes without grad
        self.schedule.unit_entered(unit)
        self.updates.wait(unit)
        if self.phase.now is Phase.FORWARD:
            self._prefetch(self.trace.visit("forward", unit.index))
        if cycling:  # [Note: forward cycles]
            self._prefetch(self.cycle.visit(unit, pending_backward=bool(self.gradients.backward_pass.runs)))
        kept_in = self.cycle.keeps(unit)
        self._gather(unit, kept_in or Tier.DEVICE)
        if kept_in is not None:
            self.cycle.gathered(unit)
        if self.schedule.needs_views(unit):
            views = unit.bind_views()
            if not self.phase.now.backward and torch.is_grad_enabled():
                self.gradients.ran(unit)
            self.schedule.views_bound(unit, views)

    def unit_forward_end(self, unit: FlatUnit) -> None:
        # ZeRO-3: the full parameters exist only while the unit runs (or, recomputed under
        # activation checkpointing, until its backward); in a train_batch, until the last
        # micro-batch has run it.
        if self.phase.now is Phase.FORWARD and self.schedule.holds("forward", unit):
            return
        if not self.phase.now.backward and not self.cycle.holds(unit):
            unit.release()

    def unit_backward_start(self, unit: FlatUnit) -> None:
        self.cycle.end()
        self.in_backward()
        self.updates.wait(unit)
        self._prefetch(self.trace.visit("backward", unit.index))
        self._gather(unit)
        if not unit.views_bound:
            # Activation checkpointing may recompute the unit's forward without its forward hooks
            # (a train_batch's in-place checkpoint, runtime/vertical.py; Hugging Face's), and the
            # recomputed forward reads the modules' attributes. With grad, as in forward: views
            # that required none would change what the recomputation saves.
            with torch.enable_grad():
                unit.bind_views()

    def unit_grad_ready(self, unit: FlatUnit, grads: list[torch.Tensor | None]) -> None:
        """Backward is done with the unit (`grads`: its parameters' gradients): the gradient path
        reduces, keeps or hands them over, and lets the unit go."""
        self.in_backward()
        self.gradients.receive(unit, grads, self.lr_schedule.lr)

    def unit_backward_end(self, unit: FlatUnit) -> None:
        """Backward is done with a frozen unit (its module's inputs have their gradients), or a root
        unit ran without grad: let the full parameters go (in a train_batch, after the last
        micro-batch's)."""
        if not self.schedule.holds("backward", unit) and not self.cycle.holds(unit):
            unit.release()

    # -- the phase -------------------------------------------------------------------------------

    def in_backward(self) -> None:
        """Called by every hook autograd runs. Outside `backward()` and `train_batch()`, the caller
        ran `loss.backward()` itself: the pass is then the engine's backward, and its micro-step
        ends at the engine's next call (`_engine_call` in engine.py ends it first). Not at the end
        of autograd's pass: a reentrant checkpoint runs a nested pass, whose end is not the end of
        backward."""
        if self.phase.now is Phase.PLAIN_BACKWARD:
            self.watch.enter()  # each graph task of the pass: runtime/backward_watch.py
            return
        if self.phase.now is Phase.BACKWARD:
            return
        self.refuse_a_full_window()
        if self.scaler.enabled:
            raise RuntimeError("fp16 training needs engine.backward(loss) in place of loss.backward(): the "
                               "engine scales the loss there, and unscaled fp16 gradients would underflow.")
        self.phase.begin_plain_backward()
        self.watch.enter()

    def refuse_a_full_window(self) -> None:
        """A backward pass beyond the window's `grad_accumulation`, before `step()`: its gradient
        would be summed into one the norm has already been taken of, and without clipping the
        updates have already spent it. So it is refused, before any gradient of it lands."""
        if not self.gradients.window_complete:
            return
        self.reshard_all()  # what the refused pass's forward gathered for it
        spent = ", and its updates already ran during backward" if self.policy.overlapped else ""
        raise RuntimeError(f"a backward pass beyond grad_accumulation={self.policy.grad_accumulation} before step(): "
                           f"this step's gradients are complete{spent}, so another pass cannot be summed into "
                           "them. Call engine.step() first; for several backward passes per step set "
                           "Config(grad_accumulation=K), or sum the losses and call backward once.")

    def end_micro_step(self) -> None:
        """A backward pass ended: units whose gradient came in fewer parts than their runs complete
        now, every unit lets go, and updates that waited for the ranks' word start."""
        lr = self.lr_schedule.lr
        for index in self.gradients.incomplete():  # its update starts only now
            self.gradients.complete(self.units[index], lr)
        self.reshard_all()  # units that produced no gradient this time (unused) still let go
        for index in self.gradients.settle_ranks():  # their updates waited for every rank's word
            self.gradients.hand_over(self.units[index], None, lr)
        self.gradients.end_micro_step()
        self.trace.end_step()

    def engine_called(self, *, without_grad: bool) -> None:
        """An engine call begins (`_engine_call` in engine.py): the micro-step of a plain
        `loss.backward()` before it ends, and, but for a forward without grad, a cycle of passes."""
        self.end_plain_backward()
        if not without_grad:
            self.cycle.end()

    def end_plain_backward(self) -> None:
        """The engine is called again after a plain `loss.backward()` (`_engine_call`, `close`): its
        micro-step ends here."""
        if not self.watch.finished:  # it raised partway (maybe before any unit's hook), and was caught
            self.abandon_micro_step(None)
        elif self.phase.now is Phase.PLAIN_BACKWARD:
            self.phase.end()
            self.end_micro_step()

    def abandon_micro_step(self, error: BaseException | None, failed: str = "a backward pass") -> None:
        """A backward pass (or a whole train_batch: `failed` names it) raised: put the engine back as
        before it, or, where that cannot be done, stop it ([Note: a failed micro-step] in
        runtime/gradient_path.py)."""
        self.phase.end()
        self.watch.forget()
        undone = self.gradients.abandon_pass(self.units)
        self.reshard_all()
        self.trace.discard_step()
        what = f"{type(error).__name__}" if error is not None else "a loss.backward() the caller caught"
        if self.group.world > 1:
            give_up_group()  # the others learn of it now, not at their collective's timeout
            why = (f"rank {self.group.rank}: {failed} failed partway ({what}), so the ranks' collectives are "
                   "no longer in step and this process group cannot go on. Restart every rank and resume from the "
                   "last checkpoint (engine.load_checkpoint()).")
            self.updates.halt(why, error)
        elif undone is Undone.NOTHING:
            why = (f"{failed} failed partway ({what}) after some units' updates had started beside it "
                   "(no clipping and no fp16: each update starts as soon as its unit's gradient is final), so "
                   "those units' parameters and optimizer states moved on and the others did not. This engine "
                   "will not step, save or export from that state: engine.load_checkpoint() restores the last "
                   "checkpoint (or close it and start again).")
            self.updates.halt(why, error)
        else:
            why = ("the engine is as before that micro-step" if undone is Undone.PASS else
                   "its gradients were already summed into those of the window's earlier micro-steps, so the "
                   "whole accumulation window was dropped; the next backward starts a new one")
            why = f"{failed} failed partway ({what}): {why}."
        log.warning("%s", why)
        if error is not None:
            error.add_note(f"outcore: {why}")

    # -- gathering -------------------------------------------------------------------------------

    def reshard_all(self, *, keep_cycle: bool = False) -> None:
        """Let every unit go; `keep_cycle`: but those a cycle of passes keeps ([Note: forward cycles])."""
        if not keep_cycle:
            self.cycle.end()
        for u in self.units:
            if not self.cycle.holds(u):
                u.release()

    def gathered_bytes(self) -> int:
        return sum(u.flat.untyped_storage().nbytes() for u in self.units  # borrowed ones are in the store
                   if u.state is UnitState.UNSHARDED and not u.aliased and not u.borrowed)

    def _gather(self, unit: FlatUnit, tier: Tier = Tier.DEVICE) -> None:
        """The unit's whole parameters, gathered unless they already are (a resident unit, the root
        unit in backward, a unit recomputed under activation checkpointing); borrowed from `tier`."""
        if unit.state is UnitState.SHARDED:
            unit.unshard(tier)
        self.gathered_peak = max(self.gathered_peak, self.gathered_bytes())

    def _prefetch(self, unit_indices: list[int]) -> None:
        """Start bringing the parameter shards of the units expected next (`prefetch_depth` of them)
        closer: the nearest `device_ahead` onto the device, the rest from NVMe into HOST
        (`StatePolicy.device_window`; the two levels of docs/design.md)."""
        # A unit still being updated is skipped: its update brings its shard into memory itself.
        # (A finished update stays pending until the unit is next gathered: not skipped.)
        keys = [self.units[i].param_key for i in unit_indices if not self.updates.updating(i)
                and not self.units[i].resident and self.units[i].state is UnitState.SHARDED]
        if keys:
            self.store.prefetch(keys[: self.device_ahead], Tier.DEVICE)
            if self.place.param_tier == Tier.NVME and len(keys) > self.device_ahead:
                self.store.prefetch(keys[self.device_ahead :], Tier.HOST)
