"""The optimizer's side of a step: every unit's AdamW update, where and when it runs.

Updates run on one optimizer thread, so that their reads, fused kernels and write-backs overlap
compute. Two ways in:
- `overlap(unit, ...)`: during backward, as soon as a unit's gradient is final (no clipping, no
  fp16 overflow check; `StatePolicy.overlapped`);
- `start(units, ...)`: after backward, once the global norm is known, in the order the next
  forward wants the units.
Either way a unit's future completes once its last chunk is written, and `wait(unit)` is what a
unit's next gather, a checkpoint or a state dict calls before reading it. `drain()` waits for all.
The stream also keeps the optimizer's step counts (AdamW's bias correction; runtime/step_counts.py).
`idle`, where given, names by unit index the parameters that got no gradient this step: they sit
the update out, as torch.optim skips a parameter whose `.grad` is None.

[Note: speculative clipping] With clipping, an update needs the global norm, known only once
backward has ended. Waiting for it holds every gradient until the step, and under small budgets
they spill to NVMe and back, and the parameter shards are read once more for the update
(docs/benchmarks.md). Most fine-tuning steps do not clip. So while the last step did not
(`StatePolicy.speculates`), each unit's update runs behind backward as if this one will not, in
place, as an unclipped update does. Before it, the store keeps the unit's moments aside
(offload/kept_versions.py [Note: kept versions]): moments resting on NVMe are clean when read
(each update writes them back) and are kept where they lie in the swap file, at no cost in memory
or I/O. Units whose moments rest in HOST wait for the norm, as before: which units speculate
depends on the plan, not on timing, so a run and its resumption take the same path, bit for bit.
At the step:
- a clip coefficient of 1 makes each speculation exact (clip_grad_norm_ multiplies by 1.0), and
  the kept moments are let go;
- below 1, each unit is updated again (runtime/speculative_redo.py): its parameters are taken back
  from the new moments (always so, even where the shard was kept: the same bits whatever the
  timing), its old moments come back, and its gradient, recovered from the two first moments to
  within a few ulps, is applied scaled. The next step then waits for the norm;
- a non-finite norm takes every speculation back: the step is skipped, as without it.
A failed backward pass takes back the speculations it started. The step counts advance once a
unit's update is settled, so that a redo runs with the count the speculation had. The bytes of a
step that does not clip are those of the unclipped step; one that clips reads the new and the kept
moments again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import torch

from outcore.offload import Tier, TieredStore
from outcore.offload.background import background_pool
from outcore.offload.handle import Handle
from outcore.runtime.flat_unit import Chunk, FlatUnit
from outcore.runtime.optimizer import AdamW, ParamWriter, update_chunks
from outcore.runtime.policy import HANDED_OVER, Placement
from outcore.runtime.speculative_redo import redo_clipped
from outcore.runtime.step_counts import StepCounts
from outcore.runtime.stochastic_rounding import StochasticRounding


class Halted(RuntimeError):
    """The engine refuses to go on from its states until a checkpoint is loaded; says why."""


class UpdateStream:
    """Owns the optimizer thread, the updates in flight and the units' step counts."""

    def __init__(self, units: list[FlatUnit], store: TieredStore, place: Placement, hp: AdamW, *,
                 read_ahead: int, nice: int, rounding: StochasticRounding | None = None) -> None:
        self.units, self.store, self.place, self.hp = units, store, place, hp
        self.rounding = rounding  # bf16 optimizer states: updated in fp32, rounded back
        self.depth = max(1, read_ahead)  # chunks: runtime/memory_plan.py [Note: optimizer read-ahead]
        self.counts = StepCounts(len(units))  # optimizer updates each unit, and parameter, has taken
        self.seconds = 0.0  # time spent in updates, either way in
        self._thread = background_pool(1, "outcore-optim", nice)
        self._pending: dict[int, Handle[None]] = {}  # unit index -> its update
        # Overlapped updates of a one-micro-step window, oldest first: backward waits while
        # HANDED_OVER of them are still running. That bounds the gradients alive at once, in memory
        # or as store keys; unbounded, a GPU's backward outruns updates on the CPU and its gradients
        # push the optimizer states out of the host budget.
        self._behind_backward: deque[Handle[None]] = deque()
        # Units in the order their gradients were final, this step and the last: an overlapped
        # update prefetches the optimizer states of the unit expected after it.
        self._order: list[int] = []
        self._next: dict[int, int] = {}
        # Speculative updates of this window (unit index -> its lr and idle slots), in the order they
        # started: see [Note: speculative clipping].
        self._speculated: dict[int, tuple[float, frozenset[int]]] = {}
        # Units, over the run (stats()): speculations that stood, were redone or taken back, and units
        # of a speculating window that waited for the norm (their states could not be kept).
        self.speculated = {"kept": 0, "redone": 0, "taken_back": 0, "waited": 0}
        # The first update that failed (or a checkpoint load that stopped partway): raised once, to
        # whoever waited for it. The states are then partly written, so every later use of the
        # stream refuses until a load succeeds (close() only cleans up).
        self.failed: BaseException | None = None

    # -- starting updates -------------------------------------------------------------------------

    def overlap(self, unit: FlatUnit, lr: float, handed: list[list[torch.Tensor]] | None,
                idle: Mapping[int, frozenset[int]], *, bounded: bool, speculative: bool = False) -> None:
        """Update `unit` now, behind backward; `handed`: its gradient in memory, per chunk (else
        the chunks' gradient keys in the store). `bounded`: its gradient was made in this backward
        alone (a window of one micro-step), so waiting for earlier updates frees memory.
        `speculative`: unclipped, its states kept aside (`keep_states`) until `settle_speculation`
        ([Note: speculative clipping])."""
        self.check()
        if speculative:
            self._speculated[unit.index] = (lr, frozenset(idle.get(unit.index, ())))
        self._order.append(unit.index)
        following = self._next.get(unit.index)
        then = self.units[following].chunks if following is not None else []
        if bounded:
            behind = self._behind_backward
            while behind and (behind[0].done() or len(behind) >= HANDED_OVER):
                self._result(behind.popleft())
        future: Handle[None] = Handle()
        running = self._thread.submit(self._timed, unit.chunks, lr, 1.0, then, None, handed, dict(idle), speculative)
        running.add_done_callback(lambda done: future.set_done(done.exception()))
        self._pending[unit.index] = future
        if bounded:
            self._behind_backward.append(future)

    def start(self, units: list[FlatUnit], lr: float, coef: float,
              kept: dict[int, list[list[torch.Tensor]]] | None = None,
              idle: Mapping[int, frozenset[int]] | None = None) -> None:
        """Update `units`, in this order, with gradients scaled by `coef` (the clip coefficient).
        `kept`: the gradients in memory, per unit and chunk (`StatePolicy.step_in_memory`), else
        in the store.

        States on DEVICE take one fused call, here, as torch.optim.AdamW(fused=True) does (bf16
        states one a chunk, so that their fp32 copies are one chunk's). The
        others go to the optimizer thread chunk by chunk, and each unit's future completes as its
        last chunk is written; so do states resting in HOST beside the work, since one call would
        hold every unit's states, gradient and master at once, past the least host budget
        (runtime/memory_plan.py counts a chunk at a time)."""
        self.check()
        idle = dict(idle or {})  # by value: the caller's window resets while these updates run
        chunks = [c for u in units for c in u.chunks]
        if self.place.opt_tier == self.place.work_tier == Tier.DEVICE:  # nothing to stream: one fused call
            t0 = time.perf_counter()
            grads = [pieces for u in units for pieces in kept[u.index]] if kept is not None else None
            assert grads is None or self.rounding is None, "bf16 states keep no gradient in memory (StatePolicy)"
            with ParamWriter(self.store, self.place) as params:
                # bf16 states: a chunk at a time, so that their fp32 copies stay one chunk's
                for part in [chunks] if self.rounding is None else [[c] for c in chunks]:
                    update_chunks(part, self.store, self.place, self.hp, params, self.counts, lr=lr,
                                  grad_scale=coef, grads=grads, idle=idle, rounding=self.rounding)
            for u in units:
                self.counts.advance(u.index, len(u.plan.slots), idle.get(u.index, ()))
            self.seconds += time.perf_counter() - t0
            return
        futures: dict[int, Handle[None]] = {u.index: Handle() for u in units}
        self._pending.update(futures)
        self._submit(futures, lambda: self._timed(chunks, lr, coef, (), futures, None, idle))

    def _submit(self, futures: dict[int, Handle[None]], work: Callable[[], None]) -> None:
        """Run `work` on the optimizer thread, which completes `futures` unit by unit; if it raises,
        each of them not done yet fails with its error."""

        def run() -> None:
            try:
                work()
            except BaseException as e:
                for f in futures.values():
                    if not f.done():
                        f.set_exception(e)
                raise

        self._thread.submit(run)

    # -- speculation ([Note: speculative clipping]) ------------------------------------------------

    def keep_states(self, unit: FlatUnit) -> bool:
        """Keep the states an update of `unit` changes aside, where the store can at no cost
        (offload/kept_versions.py). True where its moments were kept, and its update may then
        speculate: moments resting on NVMe, which are clean when read (written back after each
        update), so that which units speculate does not depend on timing. Its parameter shard is
        kept where it can be too, for an exact take-back after a failed pass (a redo always finds it
        again from the moments: runtime/speculative_redo.py)."""
        if self.place.opt_home(unit.index) != Tier.NVME:  # resting in HOST: dirty, only a copy would keep them
            return False
        if not self.store.keep([c.opt_key for c in unit.chunks]):
            self.speculated["waited"] += 1
            return False
        self.store.keep([unit.param_key])
        return True

    def settle_speculation(self, coef: float) -> None:
        """At the step, once the clip coefficient is known: the window's speculative updates stand
        (`coef` 1: their kept states are let go) or are done again from the kept states with the
        gradient scaled by `coef`. Each unit's future completes when it is settled; the work runs on
        the optimizer thread, after the speculative updates."""
        self.check()
        speculated, self._speculated = self._speculated, {}
        if not speculated:
            return
        started = [f for index in speculated if (f := self._pending.get(index)) is not None]
        futures: dict[int, Handle[None]] = {index: Handle() for index in speculated}
        self._pending.update(futures)

        def settle() -> None:
            for f in started:  # done (the same thread ran them): a failed one fails its step
                error = f.outcome()
                if error is not None:
                    raise error
            for index, (lr, idle) in speculated.items():
                unit = self.units[index]
                if coef == 1.0:
                    for key in self._kept_keys(unit):
                        self.store.drop_kept(key)
                else:
                    redo_clipped(unit, self.store, self.place, self.hp, self.counts, lr=lr, coef=coef, idle=idle)
                self.speculated["kept" if coef == 1.0 else "redone"] += 1
                self.counts.advance(index, len(unit.plan.slots), idle)
                futures[index].set_result(None)

        self._submit(futures, settle)

    def speculated_units(self) -> frozenset[int]:
        """The units updated speculatively in this window (settled at its step)."""
        return frozenset(self._speculated)

    def take_back(self, units: Sequence[int], unstarted: Sequence[int] = ()) -> bool:
        """Take back the speculative updates of `units` (a failed backward pass, or a step whose norm
        is not finite), once each is done, whatever its outcome: their kept states come back. False
        where some unit's parameter shard could not be kept: its update cannot be taken back
        exactly, and the caller stops the engine (`halt`). `unstarted`: units whose states were
        kept for an update that never started (let go)."""
        exact = True
        for index in units:
            future = self._pending.pop(index, None)
            if future is not None:
                future.outcome()  # done, whatever its outcome: nobody else will look
            if self._speculated.pop(index, None) is not None:
                self.speculated["taken_back"] += 1
            unit = self.units[index]
            exact = exact and self.store.is_kept(unit.param_key)
            for key in self._kept_keys(unit):
                self.store.restore_kept(key)
        for index in unstarted:
            for key in self._kept_keys(self.units[index]):
                self.store.drop_kept(key)
        return exact

    def _kept_keys(self, unit: FlatUnit) -> list[str]:
        """The store keys kept aside for a speculative update of `unit` (`keep_states`)."""
        keys = [c.opt_key for c in unit.chunks] + [unit.param_key]
        return [k for k in keys if self.store.is_kept(k)]

    # -- waiting ----------------------------------------------------------------------------------

    def updating(self, index: int) -> bool:
        """Unit `index`'s update is still running."""
        future = self._pending.get(index)
        return future is not None and not future.done()

    def wait(self, unit: FlatUnit) -> None:
        """Before a unit is gathered again: its update, if one is still running, has finished."""
        self.check()
        future = self._pending.pop(unit.index, None)
        if future is not None:
            self._result(future)

    def in_flight(self) -> list[Handle[None]]:
        """The handles of updates not yet waited for (finished ones included)."""
        return list(self._pending.values())

    def drain(self) -> None:
        """Wait for every update started so far."""
        self.check()
        self._settle()

    def abandon(self) -> None:
        """Before a checkpoint load replaces every state: wait for the updates in flight, whatever
        their outcome, and forget them; what speculative ones kept is let go."""
        self._take_all()
        self._behind_backward.clear()
        speculated, self._speculated = self._speculated, {}
        for index in speculated:
            for key in self._kept_keys(self.units[index]):
                self.store.drop_kept(key)

    def halt(self, why: str, cause: BaseException | None = None) -> None:
        """Something beside the updates left the states unfit to go on from (`why` says what, and
        what to do): wait for the updates in flight, then refuse every later use, as after a failed
        update, until a checkpoint load succeeds."""
        self.abandon()
        if self.failed is None:
            self.failed = Halted(why)
            self.failed.__cause__ = cause

    def loaded(self, error: BaseException | None) -> None:
        """After a checkpoint load began writing: None if it replaced every state (a failed update
        no longer stands), else the error that stopped it partway (the states are mixed now, so the
        stream refuses as after a failed update)."""
        self.failed = error

    def end_window(self) -> None:
        """An accumulation window ended: this step's order of updates predicts the next one's."""
        if self._order:
            self._next = dict(zip(self._order, self._order[1:], strict=False))
            self._order = []

    def close(self) -> None:
        """Wait for the updates in flight and stop the thread; an update error nobody has seen yet is
        raised (one already raised is not)."""
        try:
            self._settle()
        finally:
            self._thread.shutdown()

    def _settle(self) -> None:
        """Wait for every update in flight; then raise the first error among them, unless an update
        failed before."""
        for f in self._take_all():
            self._result(f)

    def _take_all(self) -> list[Handle[None]]:
        """Every update in flight, each finished (whatever its outcome) and no longer pending."""
        pending, self._pending = list(self._pending.values()), {}
        for f in pending:
            f.outcome()
        return pending

    def _result(self, future: Handle[None]) -> None:
        """Wait for `future`; raise its error if it is the first update to fail."""
        error = future.outcome()
        if error is not None and self.failed is None:
            self.failed = error
            raise error

    def check(self) -> None:
        """Raise if an earlier failure left the states unfit to go on from."""
        if self.failed is None:
            return
        error = self.failed
        if isinstance(error, Halted):
            raise Halted(str(error)) from error.__cause__
        raise RuntimeError(f"an earlier failure left the model's states partly written ({type(error).__name__}: "
                           f"{error}). This engine cannot go on until engine.load_checkpoint() restores them "
                           "all (or close it and start again from a checkpoint).") from error

    # -- on the optimizer thread ------------------------------------------------------------------

    def _timed(self, order: list[Chunk], lr: float, coef: float, then: Sequence[Chunk],
               finished: dict[int, Handle[None]] | None, grad: list[list[torch.Tensor]] | None,
               idle: dict[int, frozenset[int]], speculative: bool = False) -> None:
        t0 = time.perf_counter()
        try:
            self._stream(order, lr, coef, then, finished, grad, idle, speculative)
        finally:
            self.seconds += time.perf_counter() - t0

    def _stream(self, order: list[Chunk], lr: float, coef: float, then: Sequence[Chunk],
                finished: dict[int, Handle[None]] | None, grad: list[list[torch.Tensor]] | None,
                idle: dict[int, frozenset[int]], speculative: bool = False) -> None:
        """Chunk by chunk, with the next `depth` chunks' states on their way to the work tier (past
        the end of `order`, the optimizer states of the chunks in `then`). Each unit's step count
        advances as its last chunk is done, and then its future in `finished` (if given) completes.
        `grad`: one unit's gradient handed over in memory, per chunk (its chunks read no grad keys).
        `speculative`: the step counts advance only once the update is settled."""
        streaming = self.place.opt_tier != self.place.work_tier
        with ParamWriter(self.store, self.place) as params:
            for i, chunk in enumerate(order):
                if streaming:
                    keys = []
                    for c in order[i + 1 : i + 1 + self.depth]:
                        keys += [*self._master_keys(c), c.opt_key] + ([c.grad_key] if grad is None else [])
                    keys += [c.opt_key for c in then[: max(0, i + 1 + self.depth - len(order))]]
                    self.store.prefetch(keys, self.place.work_tier)
                update_chunks([chunk], self.store, self.place, self.hp, params, self.counts, lr=lr,
                              grad_scale=coef, grads=None if grad is None else [grad[chunk.index]], idle=idle,
                              rounding=self.rounding)
                unit = chunk.unit
                if chunk is unit.chunks[-1] and not speculative:
                    self.counts.advance(unit.index, len(unit.plan.slots), idle.get(unit.index, ()))
                    if finished is not None:
                        finished[unit.index].set_result(None)

    def _master_keys(self, chunk: Chunk) -> tuple[str, ...]:
        """The store key a chunk's update needs besides its own: its unit's parameter shard, when
        that is the master (asked for once, with the unit's first chunk) and not in usable memory."""
        unit = chunk.unit
        if chunk.index != 0 or not unit.master_is_param or unit.aliased:
            return ()
        return (unit.param_key,) if self.store.ram_tier_of(unit.param_key) is None else ()
