"""When `outcore train` says a line of progress, and the time it says is left.

A line comes every `--log-every` steps, and at least every `INTERVAL` seconds of wall time whatever
`--log-every` says: a 7B LoRA step here takes minutes, and ten of them in silence read as a hang.
The time left is the mean time a step has taken since this run (or resume) started, times the steps
left. `monotonic` is the clock; a test replaces it.
"""

from __future__ import annotations

import time

INTERVAL = 60.0  # seconds: the longest a run goes without a line
monotonic = time.monotonic


class ProgressLines:
    def __init__(self, first_step: int, steps: int, every: int) -> None:
        self.first, self.steps, self.every = first_step, steps, every
        self.started = self.last = monotonic()

    def due(self, done: int) -> bool:
        """Whether a line is due after `done` steps: every `every` steps, the last step, or `INTERVAL`
        seconds since the last line."""
        return done % self.every == 0 or done == self.steps or monotonic() - self.last >= INTERVAL

    def said(self) -> None:
        self.last = monotonic()

    def eta(self, done: int) -> str:
        """The time left after `done` steps, as "ETA 1h02m", "ETA 3m20s" or "ETA 45s"."""
        ran = done - self.first
        if ran <= 0:
            return "ETA unknown"
        left = (monotonic() - self.started) / ran * (self.steps - done)
        return f"ETA {duration(left)}"


def duration(seconds: float) -> str:
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"
