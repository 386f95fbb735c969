"""The gradient's side of a step: from a unit's finished backward to the update that spends it.

For each unit whose backward is done, `receive` reduces its parameters' gradients to this rank's
fp32 shard (runtime/flat_unit.py [Note: unit gradients]), scaled for the ranks, the accumulation
window and the fp16 loss scale, and either accumulates it in the store's work tier or, on the last
micro-step of an overlapped step, hands it to the update stream at once. It keeps what `step()`
needs: which units have a gradient, their squared norms and whether fp16 overflowed, which
`global_norm` reduces across ranks; and which parameters got no gradient on any rank in the window
(`idle`), which sit the update out as torch.optim skips them (runtime/step_counts.py).

With several ranks, which parameters got a gradient is summed across them once per backward pass
(`settle_ranks`), for every unit whose gradient became final in it. A unit every parameter of which
got one here needs no other rank's word and its update starts at once; one with a parameter that
got none here waits for that sum. So the usual step adds one small collective at the end of
backward, not one per unit, which on a GPU would wait for backward's kernels unit by unit.

[Note: a failed micro-step] A backward pass that raises partway (a bad node, an out-of-memory,
Ctrl-C) has reduced the gradients of some units and not of others. `abandon_pass` undoes it:
- In the window's first micro-step (every train_batch), the window holds only this pass's
  gradients: all are dropped, exactly as if it never ran.
- In a later one, gradients new in this pass are dropped and the window's bookkeeping goes back to
  the copy taken at the pass's first gradient. A unit whose gradient this pass already added into
  the window's cannot be taken apart again (the fp32 sum does not subtract back exactly, and
  keeping the addend would cost a gradient's memory every step): the whole window is dropped, and
  the error's note says so.
- Updates speculated beside the pass (runtime/update_stream.py [Note: speculative clipping]) are
  taken back: their states were kept aside for exactly that.
- Where updates had started beside the pass (no clipping and no fp16), those units' parameters
  and optimizer states moved on. Undoing that means keeping a copy of every state an update
  overwrites, 12 bytes a parameter more, or reading it twice, on every step for the sake of a rare
  failure: the engine stops instead (`UpdateStream.halt`) and refuses every step, save and export
  until `load_checkpoint`.
With several ranks the ranks' collectives are out of step after a failed pass, on every rank: the
engine gives up its process group, which tells the others at once, and stops the same way.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field, replace

import torch

from outcore.offload import TieredStore
from outcore.runtime.collectives import Group, all_reduce_sum
from outcore.runtime.flat_unit import Chunk, FlatUnit
from outcore.runtime.loss_scale import LossScaler
from outcore.runtime.policy import Placement, StatePolicy
from outcore.runtime.update_stream import UpdateStream

log = logging.getLogger(__name__)


@dataclass
class Window:
    """What an accumulation window has gathered so far; `GradientPath.reset` replaces it whole."""

    # Backward passes per window, and micro-batches per window (the gradient's divisor): both
    # grad_accumulation, but a train_batch of K is one backward pass over K micro-batches.
    window_steps: int
    micro_batches: int = 0
    micro: int = 0  # backward passes ended in this window
    with_gradient: set[int] = field(default_factory=set)  # units given a gradient in this window
    final: set[int] = field(default_factory=set)  # of those, units whose gradient was final in the last micro-step
    # `StatePolicy.step_in_memory`: each unit's gradient, per chunk, as autograd made it, until step()
    kept: dict[int, list[list[torch.Tensor]]] = field(default_factory=dict)
    sqnorm: dict[int, float] = field(default_factory=dict)
    used: dict[int, list[bool]] = field(default_factory=dict)  # by unit: which slots got a gradient here so far
    idle: dict[int, frozenset[int]] = field(default_factory=dict)  # by unit: slots with none on any rank
    overflow: bool = False

    def __post_init__(self) -> None:
        self.micro_batches = self.micro_batches or self.window_steps

    def bookmark(self) -> Window:
        """A copy to go back to: the bookkeeping copied, the kept gradients' tensors shared."""
        return replace(self, with_gradient=set(self.with_gradient), final=set(self.final), kept=dict(self.kept),
                       sqnorm=dict(self.sqnorm), used={i: list(u) for i, u in self.used.items()},
                       idle=dict(self.idle))


@dataclass
class BackwardPass:
    """One backward pass, by unit index; replaced at the end of each micro-step."""

    runs: dict[int, int] = field(default_factory=dict)  # the runs forward made of the unit (its gradient's parts)
    parts: dict[int, int] = field(default_factory=dict)  # the parts come so far
    final_now: list[int] = field(default_factory=list)  # units whose gradient became final in this pass
    waiting: set[int] = field(default_factory=set)  # of those, units whose update waits for `settle_ranks`
    before: Window | None = None  # the window as this pass found it, taken at its first gradient
    streamed: int = 0  # updates started beside this pass (`StatePolicy.overlapped`)
    kept: set[int] = field(default_factory=set)  # units whose states are kept aside for a speculative update
    speculated: list[int] = field(default_factory=list)  # units updated speculatively beside this pass


class Undone(enum.Enum):
    """What `GradientPath.abandon_pass` could undo of a failed backward pass."""

    PASS = "the pass"  # the window is as before it
    WINDOW = "the window"  # its gradients were summed into the window's: the whole window is dropped
    NOTHING = "nothing"  # updates had started beside it: the states moved on


class GradientPath:
    """Gradients of one accumulation window: reduced, accumulated, normed, handed over."""

    def __init__(self, store: TieredStore, policy: StatePolicy, place: Placement, group: Group,
                 scaler: LossScaler, updates: UpdateStream, *, device: torch.device,
                 work_device: torch.device) -> None:
        self.store, self.policy, self.place, self.group = store, policy, place, group
        self.scaler, self.updates = scaler, updates
        self.device, self.work_device = device, work_device  # compute, and where updates run
        self.window = Window(policy.grad_accumulation)
        self.backward_pass = BackwardPass()
        # This window's updates run behind backward before the norm is known, until a step clips
        # (runtime/update_stream.py [Note: speculative clipping]); the engine sets it at each step.
        self.speculating = policy.speculates
        self._said_incomplete = False

    # The window's fields that the engine reads.
    @property
    def micro(self) -> int:
        return self.window.micro

    @property
    def with_gradient(self) -> set[int]:
        return self.window.with_gradient

    @property
    def kept(self) -> dict[int, list[list[torch.Tensor]]]:
        return self.window.kept

    @property
    def idle(self) -> dict[int, frozenset[int]]:
        return self.window.idle

    @property
    def window_complete(self) -> bool:
        """The accumulation window is full: `step()` updates."""
        return self.window.micro >= self.window.window_steps

    def begin_batch(self, micro_batches: int) -> None:
        """The window is one backward pass over `micro_batches` (Engine.train_batch), until `reset`."""
        assert self.window.micro == 0, "a train_batch inside an accumulation window"
        self.window.window_steps, self.window.micro_batches = 1, micro_batches

    def end_micro_step(self) -> None:
        self.window.micro += 1
        self.backward_pass = BackwardPass()

    def forward_failed(self, runs_before: dict[int, int]) -> None:
        """A forward raised: the runs it recorded will see no backward."""
        self.backward_pass.runs = runs_before

    def ran(self, unit: FlatUnit) -> None:
        """Forward ran `unit` (bound its views with grad): its gradient comes in one more part."""
        self.backward_pass.runs[unit.index] = self.backward_pass.runs.get(unit.index, 0) + 1

    def incomplete(self) -> list[int]:
        """Units given some parts of their gradient in this backward pass but not all: an output of
        one of their runs had no backward."""
        return [i for i, n in self.backward_pass.parts.items() if n < self.backward_pass.runs.get(i, 0)]

    def complete(self, unit: FlatUnit, lr: float) -> None:
        """What came of `unit`'s gradient is all of it (see `incomplete`); the log says so once."""
        now = self.backward_pass
        if not self._said_incomplete:
            self._said_incomplete = True
            log.info("%s ran %d times in forward and got %d gradients in backward; its update waited for the end "
                     "of backward", unit.name, now.runs[unit.index], now.parts[unit.index])
        now.runs[unit.index] = now.parts[unit.index]
        self.receive(unit, [None] * len(unit.plan.slots), lr, part=False)

    def receive(self, unit: FlatUnit, grads: list[torch.Tensor | None], lr: float, *, part: bool = True) -> None:
        """Backward is done with one run of `unit` (`grads`: its parameters' gradients from that
        run, in slot order): reduce and accumulate them, and let the unit go. A module run twice in
        a forward, or two forwards before one backward, gives its gradient in parts, one per run
        (`ran`); `part`: `grads` is one of them (else zeros that complete it). On the last part the
        unit is released before its gradient is handed over (its update changes the shard); between
        parts a block lets go too, and its next run's backward gathers it again (the root stays)."""
        handed, final = self._reduce(unit, grads, part)
        del grads
        if final or not unit.plan.root:
            unit.release()
        if final:
            self.hand_over(unit, handed, lr)

    def _reduce(self, unit: FlatUnit, grads: list[torch.Tensor | None],
                part: bool) -> tuple[list[list[torch.Tensor]] | None, bool]:
        """`receive`'s reduction. Returns the gradient shard, per chunk, when it is to be handed
        over in memory (see `hand_over`), else None; and whether this part was the last."""
        window, now = self.window, self.backward_pass
        if now.before is None:  # what `abandon_pass` goes back to
            now.before = window.bookmark()
        if part:
            now.parts[unit.index] = now.parts.get(unit.index, 0) + 1
        final = now.parts.get(unit.index, 0) >= now.runs.get(unit.index, 0)
        world = self.group.world
        first = unit.index not in window.with_gradient
        last = final and window.micro + 1 == window.window_steps
        # One micro-step whose update starts now, where the gradient already is: the update takes
        # it as it stands, with no copy into the store and no wait for room there.
        used = window.used.setdefault(unit.index, [False] * len(grads))
        for i, g in enumerate(grads):
            used[i] = used[i] or g is not None
        waits = last and world > 1 and not all(used)  # for the other ranks' word: `settle_ranks`
        speculates = last and not waits and self.speculating  # unless its states cannot be kept: `hand_over`
        hand_over = (first and last and not waits and unit.device == self.work_device
                     and self.policy.hands_over_window(window.window_steps, speculating=speculates))
        in_memory = self.policy.step_in_memory and window.window_steps == 1
        with torch.no_grad():
            pieces = unit.gradient_pieces(grads, 1.0 / (world * window.micro_batches * self.scaler.scale),
                                          keep=hand_over)
            del grads
            if last:
                window.final.add(unit.index)
                now.final_now.append(unit.index)
                if waits:
                    now.waiting.add(unit.index)
                elif world == 1:
                    self._settle([unit.index])
            window.with_gradient.add(unit.index)
            if in_memory:
                self._keep(unit, pieces, whole=first and last)
                return None, final
            sqnorm = 0.0
            for c, parts in zip(unit.chunks, pieces, strict=True):
                if first and not hand_over:
                    self._put(c, parts)
                elif not first:
                    acc = self.store.fetch_now(c.grad_key, self.place.work_tier)
                    parts = [p.to(acc.device) for p in parts]  # from a GPU to a HOST work tier
                    torch._foreach_add_(list(acc.split([p.numel() for p in parts])), parts)
                    if last and self.policy.needs_norm:
                        sqnorm += float(torch.linalg.vector_norm(acc)) ** 2  # fp32 norms, as clip_grad_norm_
                    self.store.release(c.grad_key, dirty=True)
                if last and first and self.policy.needs_norm:
                    sqnorm += sum(float(n) ** 2 for n in torch._foreach_norm(parts))
            if last:
                window.sqnorm[unit.index] = sqnorm
                if self.scaler.enabled and not math.isfinite(sqnorm):
                    window.overflow = True
        return (pieces if hand_over else None), final

    def _keep(self, unit: FlatUnit, pieces: list[list[torch.Tensor]], *, whole: bool) -> None:
        """`StatePolicy.step_in_memory`: the gradient stays in memory until `step()`. A whole one as
        autograd made it; one in parts is summed into a copy (autograd's pieces may alias)."""
        if whole:
            self.window.kept[unit.index] = pieces
        elif unit.index not in self.window.kept:
            self.window.kept[unit.index] = [[torch.cat(parts)] for parts in pieces]
        else:
            for acc, parts in zip(self.window.kept[unit.index], pieces, strict=True):
                acc[0].add_(torch.cat(parts))

    def finish_window(self, units: list[FlatUnit]) -> list[FlatUnit]:
        """At the end of the window, before `global_norm`: the units given a gradient in an earlier
        micro-step but not run in the last one (a branch taken earlier), whose final part never came.
        Their squared norms and idle slots are taken now, from the gradient accumulated in the
        store, in unit order on every rank. Returns them: an overlapped step started only the others."""
        late = [u for u in units if u.index in self.window.with_gradient and u.index not in self.window.final]
        for unit in late:
            assert not self.window.kept, "gradients kept in memory come in one micro-step: none is late"
            if self.policy.needs_norm:
                sqnorm = 0.0
                for c in unit.chunks:
                    acc = self.store.fetch_now(c.grad_key, self.place.work_tier)
                    sqnorm += float(torch.linalg.vector_norm(acc)) ** 2
                    self.store.release(c.grad_key)
                self.window.sqnorm[unit.index] = sqnorm
                if self.scaler.enabled and not math.isfinite(sqnorm):
                    self.window.overflow = True
            self.window.final.add(unit.index)
        self._settle([u.index for u in late])
        return late

    def settle_ranks(self) -> list[int]:
        """At the end of a backward pass, with several ranks: which parameters of the units whose
        gradient became final in it got a gradient on any rank, summed in one collective (the same
        units, in the same order, on every rank). Returns the units whose update waited for it."""
        settled, self.backward_pass.final_now = self.backward_pass.final_now, []
        waiting, self.backward_pass.waiting = sorted(self.backward_pass.waiting), set()
        if self.group.world > 1 and settled:
            self._settle(sorted(settled))
        return waiting

    def _settle(self, order: list[int]) -> None:
        """These units' gradients are final: their slots that got none, here or, with several ranks,
        on any (summed in one collective: every rank passes the same units in the same order)."""
        used = [self.window.used.pop(i) for i in order]
        flags = [f for unit in used for f in unit]
        if self.group.world > 1 and flags:
            summed = torch.tensor(flags, dtype=torch.float32, device=self.device)
            all_reduce_sum(summed, self.group)
            flags = [f > 0 for f in summed.tolist()]
        at = 0
        for index, unit in zip(order, used, strict=True):
            idle = frozenset(s for s in range(len(unit)) if not flags[at + s])
            at += len(unit)
            if idle:
                self.window.idle[index] = idle

    def hand_over(self, unit: FlatUnit, handed: list[list[torch.Tensor]] | None, lr: float) -> None:
        """Once the unit's gradient is final and the unit released (an update changes its shard): on the last
        micro-step of an overlapped step, its update starts now, behind the rest of backward; of a
        speculating one, where its states could be kept aside."""
        window, now = self.window, self.backward_pass
        if window.micro + 1 != window.window_steps or unit.index in now.waiting:
            return
        bounded = window.window_steps == 1
        if self.policy.overlapped:
            self.updates.overlap(unit, lr, handed, window.idle, bounded=bounded)
            now.streamed += 1
        elif not self.speculating:
            return
        elif not math.isfinite(window.sqnorm.get(unit.index, 0.0)):  # never applied, even for a moment
            self.speculating = False
            if handed is not None:
                self._put_all(unit, handed)
        elif self.updates.keep_states(unit):  # at no cost: [Note: kept versions] in offload/kept_versions.py
            now.kept.add(unit.index)
            self.updates.overlap(unit, lr, handed, window.idle, bounded=bounded, speculative=True)
            now.speculated.append(unit.index)  # taken back if the pass fails
        elif handed is not None:  # its gradient waits for the norm after all, in the store
            self._put_all(unit, handed)

    def _put_all(self, unit: FlatUnit, handed: list[list[torch.Tensor]]) -> None:
        """A gradient that was to be handed over waits in the store after all."""
        for c, parts in zip(unit.chunks, handed, strict=True):
            self._put(c, parts)

    def global_norm(self, grad_clip: float | None) -> tuple[float | None, float, bool]:
        """Gradient norm over all shards and ranks, the clip coefficient, and fp16 overflow (a norm
        of None where none is needed: `StatePolicy.needs_norm`)."""
        if not self.policy.needs_norm:
            return None, 1.0, False
        total = torch.tensor([sum(self.window.sqnorm.values()), float(self.window.overflow)], dtype=torch.float64,
                             device=self.device)  # NCCL reduces device tensors only
        all_reduce_sum(total, self.group)
        overflow = bool(total[1] > 0) or not math.isfinite(float(total[0]))
        norm = math.sqrt(float(total[0])) if not overflow else float("inf")
        coef = 1.0
        if grad_clip is not None and not overflow:
            coef = min(1.0, grad_clip / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
        return norm, coef, overflow

    def reset(self, units: list[FlatUnit], *, drop_grads: bool) -> None:
        """End an accumulation window. `drop_grads`: no update will spend its gradients (a skipped
        step, or a window a checkpoint load abandons), so drop them here, never written back."""
        if drop_grads:
            self._drop([u for u in units if u.index in self.window.with_gradient])
        self.window = Window(self.policy.grad_accumulation)
        self.backward_pass = BackwardPass()
        self.updates.end_window()

    def abandon_pass(self, units: list[FlatUnit]) -> Undone:
        """A backward pass raised partway: undo what it did to the window ([Note: a failed micro-step]).
        Returns what was undone; the caller releases the units and, for `Undone.NOTHING`, stops
        the engine until a checkpoint is loaded."""
        now, before = self.backward_pass, self.backward_pass.before or self.window  # None: no gradient came
        self.backward_pass = BackwardPass()
        exact = self.updates.take_back(now.speculated, sorted(now.kept - set(now.speculated)))
        if now.streamed or not exact:
            return Undone.NOTHING
        new = self.window.with_gradient - before.with_gradient
        summed = set(now.parts) & before.with_gradient  # added into what earlier micro-steps left there
        if before.micro == 0 or summed:  # the window holds nothing else, or nothing else apart
            self.reset(units, drop_grads=True)
            return Undone.WINDOW if summed else Undone.PASS
        self._drop([u for u in units if u.index in new])
        self.window = before
        return Undone.PASS

    def _drop(self, units: list[FlatUnit]) -> None:
        """Delete the gradients the store holds for `units`."""
        for u in units:
            for c in u.chunks:
                if c.grad_key in self.store:
                    self.store.delete(c.grad_key)

    def _put(self, chunk: Chunk, parts: list[torch.Tensor]) -> None:
        """A chunk's first gradient into the store's work tier: its pieces concatenated straight into
        the store's buffer where they share its device, else through `put`'s copy."""
        tier = self.place.work_tier
        if len(parts) == 1 or parts[0].device != self.work_device:
            self.store.put(chunk.grad_key, parts[0] if len(parts) == 1 else torch.cat(parts), tier)
            return
        staged = self.store.stage(chunk.grad_key, (chunk.numel,), torch.float32, tier)
        try:
            torch.cat(parts, out=staged.tensor)
        except BaseException as e:
            staged.abort(e)
            raise
        staged.commit()
