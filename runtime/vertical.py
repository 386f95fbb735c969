"""Vertical accumulation: K micro-batches as one optimizer step, each unit gathered once in forward
and once in backward for all K (`Engine.train_batch`).

[Note: vertical schedule] Plain accumulation runs micro-batch by micro-batch, so every unit's
parameters are gathered (read from NVMe) K times in forward and K times in backward. Here the K
forwards run unit by unit instead: unit 0 for every micro-batch, then unit 1 for every
micro-batch, and so on. The model's own forward code is not rewritten for this: each micro-batch
runs `model(...)` in its own greenlet (a coroutine with its own stack, on the calling thread), and
they take turns (`Turns`), passing the turn at every unit's forward pre-hook. So the code between
units (embeddings, masks, rotary tables, the head and the loss) is the model's own.

Backward is one call over the K losses. Autograd runs the ready node created last first, so it
walks the units in reverse, each for every micro-batch before the next: the order of the
forward, reversed. In fp32 each unit's parameter views are bound once for the whole batch, so
autograd sums the K micro-batches' gradients into one call of the unit's gradient callback, which
reduces and hands them to the update as a single micro-step would. In bf16 and fp16 that sum
would be in the compute dtype (and could overflow in fp16 where fp32 does not), so each
micro-batch binds views of its own, and the unit's gradient comes in K parts, each added into the
fp32 shard as K backward passes would (runtime/gradient_path.py). A unit whose forward spans the
turns (the root: the embedding before the blocks, the head after them) has its attributes pointed
back at the running micro-batch's views whenever that micro-batch gets the turn again.

The micro-batches' random draws: runtime/random_draws.py [Note: random draws]. What the batch
keeps between units, each unit's inputs for each micro-batch, pages through the store
(runtime/saved_activations.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import greenlet
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from outcore.runtime.flat_unit import FlatUnit
from outcore.runtime.random_draws import RandomDraws
from outcore.runtime.saved_activations import SavedActivations
from outcore.runtime.unit_lifecycle import OneMicroBatch, UnitLifecycle

log = logging.getLogger(__name__)


class Turns:
    """K micro-batches as greenlets on the calling thread, one running at a time, in round-robin
    order: 0, 1, ..., K-1, then 0 again. Greenlets, not threads: autograd numbers the nodes it
    records per thread, and the backward order above rests on one numbering for all K."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.current: int | None = None  # the running micro-batch; None outside them
        self._scheduler: greenlet.greenlet | None = None

    def run(self, work: Callable[[int], Any]) -> list[Any]:
        """`work(index)` for every micro-batch, taking turns at `boundary()`; their results, in order.
        The first error any of them raises is raised here, once all have stopped."""
        self._scheduler = greenlet.getcurrent()
        lets = [greenlet.greenlet(functools.partial(work, i)) for i in range(self.count)]
        results: list[Any] = [None] * self.count
        error: BaseException | None = None
        try:
            while any(not g.dead for g in lets):
                for i, g in enumerate(lets):
                    if g.dead:
                        continue
                    self.current = i
                    try:
                        out = g.switch()
                    except BaseException as e:  # noqa: BLE001 - the first is raised below
                        error = error or e
                        continue
                    if g.dead:
                        results[i] = out
        finally:
            self.current = None
            self._scheduler = None
        if error is not None:
            raise error
        return results

    def boundary(self) -> None:
        """At a unit's start: give the turn to the next micro-batch; returns when it comes back."""
        assert self._scheduler is not None
        self._scheduler.switch()


class VerticalBatch:
    """One train_batch in flight: whose turn it is, and what the hooks count per unit.
    `shared_views`: the K micro-batches share each unit's views (fp32), else each binds its own
    (see the module docstring)."""

    def __init__(self, count: int, *, shared_views: bool) -> None:
        self.count = count
        self.turns = Turns(count)
        self.shared_views = shared_views
        self.bound: set[int] = set()  # with shared views: units whose views serve every micro-batch
        self._ends: dict[tuple[str, int], int] = {}
        # Without shared views: each micro-batch's own views of each unit, by micro-batch and unit.
        self._views: list[dict[int, tuple[FlatUnit, list[torch.Tensor]]]] = [{} for _ in range(count)]

    def run(self, micro_batches: Sequence[Any], loss_fn: Callable[[Any, Any], torch.Tensor] | None,
            compute_loss: Callable[[Any], torch.Tensor] | None, *, lifecycle: UnitLifecycle, model: nn.Module,
            blocks: Sequence[nn.Module], saved: SavedActivations, random_draws: RandomDraws) -> list[torch.Tensor]:
        """The batch (as `Engine.train_batch` takes it): each micro-batch's forward and loss turn by
        turn, its activations paged by `saved`, then one backward over the sum of the losses, the
        lifecycle on this schedule meanwhile; returns the K losses with the micro-step ended. A
        failure abandons the micro-step and is raised; the units are resharded and the paged
        activations dropped either way."""

        def forward(index: int) -> torch.Tensor:
            if compute_loss is not None:
                return batch_loss(compute_loss(micro_batches[index]), micro_batches[index], None)
            return batch_loss(call_model(model, micro_batches[index]), micro_batches[index], loss_fn)

        lifecycle.schedule = self
        lifecycle.gradients.begin_batch(self.count)
        try:
            with checkpointed(blocks, model), torch.enable_grad(), uncompiled(model):
                lifecycle.phase.begin_forward()
                with saved.hooks(), random_draws.watch(self.count):
                    losses = self.turns.run(forward)
                lifecycle.phase.begin_backward()
                total = torch.stack([loss.reshape(()) for loss in losses]).sum()
                scaler = lifecycle.scaler
                (total * scaler.scale if scaler.enabled else total).backward()
        except BaseException as error:
            lifecycle.abandon_micro_step(error, "a train_batch")
            raise
        finally:
            lifecycle.phase.end()
            lifecycle.schedule = OneMicroBatch()
            saved.clear()
            lifecycle.reshard_all()
        lifecycle.end_micro_step()
        return losses

    def keep_views(self, unit: FlatUnit, views: list[torch.Tensor]) -> None:
        """`views` are the running micro-batch's views of `unit`."""
        assert self.turns.current is not None
        self._views[self.turns.current][unit.index] = (unit, views)

    def resume(self) -> None:
        """The running micro-batch has the turn again: its own views go back into the modules'
        attributes of every unit still gathered, such as the root, whose forward spans all turns
        (the other micro-batches bound theirs meanwhile)."""
        assert self.turns.current is not None
        for unit, views in self._views[self.turns.current].values():
            if unit.views_bound:
                unit.point_at(views)

    def last_of(self, moment: str, unit: int) -> bool:
        """Count one micro-batch past `moment` of `unit`; True on the K-th (the unit may then go)."""
        key = (moment, unit)
        self._ends[key] = self._ends.get(key, 0) + 1
        return self._ends[key] >= self.count

    # -- the schedule the unit lifecycle consults (runtime/unit_lifecycle.py `MicroBatchSchedule`) --

    def unit_entered(self, unit: FlatUnit) -> None:
        if self.turns.current is not None:
            self.turns.boundary()  # the next micro-batch's turn: [Note: vertical schedule]
            if not self.shared_views:
                self.resume()

    def needs_views(self, unit: FlatUnit) -> bool:
        # In fp32 the micro-batches share one set of views (autograd sums into them), bound again
        # only where the unit was released in between (recomputed in backward).
        return not self.shared_views or unit.index not in self.bound or not unit.views_bound

    def views_bound(self, unit: FlatUnit, views: list[torch.Tensor]) -> None:
        if self.shared_views:
            self.bound.add(unit.index)
        elif self.turns.current is not None:
            self.keep_views(unit, views)

    def holds(self, moment: str, unit: FlatUnit) -> bool:
        return not self.last_of(moment, unit.index)


@contextlib.contextmanager
def checkpointed(modules: Sequence[nn.Module], model: nn.Module) -> Iterator[None]:
    """Every module in `modules` recomputes its forward in backward (torch's non-reentrant
    checkpoint) while inside; a model's own checkpointing of the same modules (Hugging Face's
    gradient checkpointing, outcore's GPT `checkpoint_activations`) is turned off meanwhile, so
    nothing is recomputed twice."""
    own = _own_checkpointing(model)
    patched = []
    try:
        for module in modules:
            if "forward" in module.__dict__:
                raise ValueError(f"{type(module).__name__}: its forward is an instance attribute; train_batch "
                                 "checkpoints each unit by wrapping it and cannot wrap this one.")
            module.forward = functools.partial(_recomputed, module.forward)
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward
        for target, name, value in own:
            setattr(target, name, value)


def _recomputed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _own_checkpointing(model: nn.Module) -> list[tuple[Any, str, Any]]:
    """Switch off the model's own activation checkpointing, and a Hugging Face model's key/value
    cache (a recomputed layer would append to it twice, as HF's own checkpointing also knows);
    returns what to restore."""
    restore: list[tuple[Any, str, Any]] = []
    configs: dict[int, Any] = {}  # an encoder-decoder's stacks carry configs of their own
    for m in model.modules():
        for name in ("gradient_checkpointing", "checkpoint_activations", "checkpointing"):
            if getattr(m, name, None) is True:
                restore.append((m, name, True))
                setattr(m, name, False)
        config = getattr(m, "config", None)
        if config is not None:
            configs[id(config)] = config
    for config in configs.values():
        if getattr(config, "use_cache", False) is True:
            restore.append((config, "use_cache", True))
            config.use_cache = False
    return restore


def views_gathered_unit(units: Sequence[Any], t: torch.Tensor) -> bool:
    """`t` is (a view of) a gathered unit's parameters (`FlatUnit`s): saved as it is, never paged."""
    ptr = t.untyped_storage().data_ptr()
    return any(u.flat.untyped_storage().data_ptr() == ptr for u in units if u.is_gathered)


def micro_batch_count(micro_batches: Any) -> int:
    """K of a train_batch: the length of its sequence of micro-batches, at least one."""
    if not isinstance(micro_batches, Sequence):  # an iterator would be drained whole (a DataLoader's epoch)
        raise TypeError(f"train_batch takes a list of micro-batches, K = its length; got a "
                        f"{type(micro_batches).__name__}. From an iterator take K of them: "
                        "list(itertools.islice(iterator, K)).")
    if not micro_batches:
        raise ValueError("train_batch needs at least one micro-batch.")
    return len(micro_batches)


def batch_loss(output: Any, micro_batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> torch.Tensor:
    """The micro-batch's loss: `loss_fn(output, micro_batch)`, else the output itself (a tensor, or an
    object with a `.loss`, as Hugging Face models return)."""
    loss = loss_fn(output, micro_batch) if loss_fn is not None else getattr(output, "loss", output)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("train_batch: the model's output is not a scalar loss; pass loss_fn(output, micro_batch) "
                         "that returns one.")
    return loss


_said_uncompiled = False


@contextlib.contextmanager
def uncompiled(model: nn.Module) -> Iterator[None]:
    """Compiled code runs eagerly inside `train_batch`, said once in the log where the model holds
    compiled modules: dynamo cannot trace the hooks that page saved activations (it fails reading
    `nbytes` of a tensor of symbolic shape)."""
    global _said_uncompiled
    if not _said_uncompiled and any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()):
        _said_uncompiled = True
        log.warning("train_batch runs the compiled model uncompiled (eagerly): torch.compile cannot trace the "
                    "hooks that page its saved activations. backward() accumulation runs it compiled.")
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch 2.6 and later
    with set_stance("force_eager") if set_stance is not None else torch._dynamo.config.patch(disable=True):
        yield


def call_model(model: nn.Module, micro_batch: Any) -> Any:
    """A micro-batch as forward arguments: a dict of keyword arguments, a tuple of positional ones,
    or one tensor."""
    if isinstance(micro_batch, dict):
        return model(**micro_batch)
    if isinstance(micro_batch, (tuple, list)):
        return model(*micro_batch)
    return model(micro_batch)
