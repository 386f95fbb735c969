"""The order units run in: recorded on the first step, used to prefetch on the next ones.

A step that takes a different path (another branch, a skipped block) is noticed at the first unit
that differs: prefetching stops for the rest of that step, it is logged once, and the step's
order is recorded in its place. Prefetching is only ever a hint, so results never change.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class Trace:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.recorded: dict[str, list[int]] = {}
        self._current: dict[str, list[int]] = {"forward": [], "backward": []}
        self._diverged = False
        self.divergences = 0

    def visit(self, phase: str, unit: int) -> list[int]:
        """Note that `unit` starts `phase`; returns the units expected next (to prefetch)."""
        seen = self._current[phase]
        if unit in seen:
            return []  # a re-entry (activation checkpointing recomputes in backward)
        pos = len(seen)
        seen.append(unit)
        expected = self.recorded.get(phase)
        if expected is None or self._diverged:
            return []
        if pos >= len(expected) or expected[pos] != unit:
            self._diverged = True
            self.divergences += 1
            if self.divergences == 1:
                log.warning("the model took a different path than the recorded one (%s unit %d); "
                            "prefetching waits for the new order to be recorded", phase, unit)
            return []
        return expected[pos + 1 : pos + 1 + self.depth]

    def end_step(self) -> None:
        """Keep this step's order when there was none, or when it changed."""
        if not self.recorded or self._diverged or any(
                self._current[p] != self.recorded.get(p) for p in self._current):
            self.recorded = {p: list(v) for p, v in self._current.items()}
        self._current = {"forward": [], "backward": []}
        self._diverged = False

    def discard_step(self) -> None:
        """Forget a forward-only pass (evaluation): it records nothing and the next step starts fresh."""
        self._current = {"forward": [], "backward": []}
        self._diverged = False
