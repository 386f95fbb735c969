"""The engine's learning rate, as torch's LR schedulers and transformers' `get_*_schedule_with_warmup`
drive it.

    engine = outcore.Engine(model, config, outcore.AdamW(lr=3e-4),
                            lr_scheduler=lambda opt: transformers.get_cosine_schedule_with_warmup(opt, 100, 10_000))

The engine runs its own AdamW over sharded states, so there is no torch optimizer holding the
parameters. `engine.optimizer` stands in for one: a `torch.optim.Optimizer` with a single parameter
group and no parameters, whose `"lr"` is the rate of the engine's next update. As a DeepSpeed engine
does with the scheduler given to `deepspeed.initialize`, the engine builds the scheduler on it,
steps it after each update it applies (not while accumulating, nor after an fp16 step skipped for an
overflow) and keeps its state in checkpoints. The group holds no betas or momentum: a scheduler
that cycles them (OneCycleLR's `cycle_momentum`) says so when it is built, instead of changing
nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from outcore.runtime.hyperparameters import check_lr

log = logging.getLogger(__name__)

SchedulerFactory = Callable[[torch.optim.Optimizer], LRScheduler]


class LearningRate(torch.optim.Optimizer):
    """One parameter group, `{"lr": ...}`, standing for the engine's optimizer. Its `step()`
    applies nothing: the engine's `step()` does, and calls this one after each update it applied,
    so that a scheduler sees the order torch expects (an optimizer step before each of its own)."""

    def __init__(self, lr: float) -> None:
        super().__init__([{"params": []}], {"lr": lr})

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        return None


class Schedule:
    """The learning rate of the next update: `optimizer.param_groups[0]["lr"]`, set by hand
    (`engine.lr = ...`) or by the scheduler the engine steps."""

    def __init__(self, lr: float, factory: SchedulerFactory | None) -> None:
        self.optimizer = LearningRate(lr)
        self.scheduler: LRScheduler | None = None
        if factory is not None:
            self.attach(factory)

    def attach(self, factory: SchedulerFactory) -> LRScheduler:
        """Build the scheduler on this optimizer; it is stepped after each update from now on."""
        scheduler = factory(self.optimizer)
        if not isinstance(scheduler, LRScheduler) or scheduler.optimizer is not self.optimizer:
            raise TypeError("Engine(..., lr_scheduler=...): give a function that builds a torch LR scheduler on "
                            "the optimizer it is passed, e.g. lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, "
                            f"f); this one returned {type(scheduler).__name__}"
                            + ("" if not isinstance(scheduler, LRScheduler) else " on another optimizer") + ".")
        self.scheduler = scheduler
        return scheduler

    @property
    def lr(self) -> float:
        return check_lr(self.optimizer.param_groups[0]["lr"], "engine.optimizer.param_groups[0]['lr']")

    @lr.setter
    def lr(self, value: float) -> None:
        self.optimizer.param_groups[0]["lr"] = check_lr(value, "engine.lr")

    def check(self) -> None:
        """ValueError if the rate set in the group (by hand or by a scheduler) is not a learning rate."""
        self.lr  # noqa: B018 - reading it checks it

    def applied(self) -> None:
        """An update ran at `lr`: the scheduler moves to the next step's rate."""
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any] | None:
        """The scheduler's state as JSON values (a checkpoint's meta.json), or None without one."""
        if self.scheduler is None:
            return None
        state = self.scheduler.state_dict()
        try:
            json.dumps(state, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the LR scheduler's state_dict() holds what a checkpoint's JSON cannot ({e}): "
                             f"{type(self.scheduler).__name__} keeps an object of its own there. Build it from a "
                             "plain function (LambdaLR keeps no function in its state), or set engine.lr "
                             "yourself.") from e
        return state

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scheduler is not None and state is not None:
            self.scheduler.load_state_dict(state)
        elif self.scheduler is not None:
            log.warning("the checkpoint holds no LR scheduler state: the scheduler goes on from where it is, at "
                        "lr %g from the checkpoint", self.lr)
        elif state is not None:
            log.warning("the checkpoint holds an LR scheduler's state and this engine has no scheduler: lr %g "
                        "from the checkpoint stays until you set engine.lr", self.lr)
