"""`outcore train`'s learning-rate schedules, with transformers' names and formulas (its
`get_scheduler`), so a fine-tuner's `--lr-scheduler cosine --warmup-ratio 0.03` means here what
`lr_scheduler_type="cosine", warmup_ratio=0.03` means to the Trainer. Written out rather than
imported: the command line trains a preset without transformers installed.

Each schedule is the multiplier of the peak rate at update `step` (0-based: the first update's rate
is the multiplier at 0, as the Trainer's scheduler gives it before its first `step()`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT = "cosine_with_min_lr"  # outcore's: linear warm-up, then cosine to `min_lr_rate` of the peak
DEFAULT_MIN_LR_RATE = 0.1
POLYNOMIAL_END, POLYNOMIAL_POWER = 1e-7, 1.0  # transformers' defaults for "polynomial"


def default_warmup(steps: int) -> int:
    """outcore's warm-up where none is asked for: a tenth of the run, at most 100 steps; none for a
    run of fewer than 10 steps (transformers' own default is none at all)."""
    return min(100, steps // 10)


def _warming(step: int, warmup: int) -> float | None:
    return step / max(1, warmup) if step < warmup else None


def _progress(step: int, warmup: int, total: int) -> float:
    return (step - warmup) / max(1, total - warmup)


@dataclass(frozen=True)
class Schedule:
    name: str
    steps: int  # the run's optimizer steps
    warmup: int  # steps of linear warm-up from 0
    peak: float  # the peak learning rate
    min_lr_rate: float = DEFAULT_MIN_LR_RATE  # cosine_with_min_lr: the floor, a fraction of the peak

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"--lr-scheduler {self.name!r}: choose from {', '.join(SCHEDULES)}.")

    def rate(self, step: int) -> float:
        """The learning rate of update `step` (0-based)."""
        return self.peak * SCHEDULES[self.name](self, step)

    def describe(self) -> str:
        floor = f" to {self.min_lr_rate:g} of it" if self.name == "cosine_with_min_lr" else ""
        return f"lr {self.peak:g}, {self.name}{floor}, {self.warmup} warm-up steps of {self.steps}"


def _constant(s: Schedule, step: int) -> float:
    return 1.0


def _constant_with_warmup(s: Schedule, step: int) -> float:
    warming = _warming(step, s.warmup)
    return 1.0 if warming is None else warming


def _linear(s: Schedule, step: int) -> float:
    warming = _warming(step, s.warmup)
    return warming if warming is not None else max(0.0, (s.steps - step) / max(1, s.steps - s.warmup))


def _cosine(s: Schedule, step: int) -> float:
    warming = _warming(step, s.warmup)
    if warming is not None:
        return warming
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * _progress(step, s.warmup, s.steps))))


def _cosine_with_restarts(s: Schedule, step: int) -> float:  # one cycle, transformers' default
    warming = _warming(step, s.warmup)
    if warming is not None:
        return warming
    progress = _progress(step, s.warmup, s.steps)
    return 0.0 if progress >= 1.0 else max(0.0, 0.5 * (1.0 + math.cos(math.pi * (progress % 1.0))))


def _cosine_with_min_lr(s: Schedule, step: int) -> float:
    warming = _warming(step, s.warmup)
    if warming is not None:
        return warming
    factor = 0.5 * (1.0 + math.cos(math.pi * _progress(step, s.warmup, s.steps)))
    return max(0.0, factor * (1 - s.min_lr_rate) + s.min_lr_rate)


def _polynomial(s: Schedule, step: int) -> float:
    warming = _warming(step, s.warmup)
    if warming is not None:
        return warming
    if step > s.steps:
        return POLYNOMIAL_END / s.peak
    remaining = 1 - (step - s.warmup) / max(1, s.steps - s.warmup)
    return ((s.peak - POLYNOMIAL_END) * remaining ** POLYNOMIAL_POWER + POLYNOMIAL_END) / s.peak


def _inverse_sqrt(s: Schedule, step: int) -> float:
    warming = _warming(step, s.warmup)
    if warming is not None:
        return warming
    timescale = s.warmup or 10_000
    return 1.0 / math.sqrt((step + timescale - s.warmup) / timescale)


SCHEDULES: dict[str, Callable[[Schedule, int], float]] = {
    "linear": _linear, "cosine": _cosine, "cosine_with_restarts": _cosine_with_restarts,
    "polynomial": _polynomial, "constant": _constant, "constant_with_warmup": _constant_with_warmup,
    "inverse_sqrt": _inverse_sqrt, "cosine_with_min_lr": _cosine_with_min_lr,
}


def warmup_steps(steps: int, warmup_steps: int | None, warmup_ratio: float | None) -> int:
    """The warm-up as the Trainer reads its two settings: steps where given, else the ratio of the
    run rounded up; outcore's default where neither is."""
    if warmup_steps is not None and warmup_ratio is not None:
        raise ValueError("--warmup-steps and --warmup-ratio both set the warm-up: give one.")
    if warmup_steps is not None:
        return warmup_steps
    if warmup_ratio is not None:
        if not 0 <= warmup_ratio <= 1:
            raise ValueError(f"--warmup-ratio {warmup_ratio}: give a fraction of the run between 0 and 1.")
        return math.ceil(steps * warmup_ratio)
    return default_warmup(steps)
