"""The prefetch queue: moves asked for ahead of use, started in order, bounded by bytes in flight.

The store owns the queue and calls it under its lock; the queue decides which request starts next
and keeps the in-flight count, the store performs the moves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from outcore.offload.handle import Handle
from outcore.offload.residency import STABLE, KeyRecord, Tier


class PrefetchQueue:
    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.inflight = 0
        self._queue: deque[tuple[str, Tier]] = deque()

    def add(self, key: str, tier: Tier) -> None:
        self._queue.append((key, tier))

    def clear(self) -> None:
        self._queue.clear()

    def pump(self, records: dict[str, KeyRecord], start: Callable[[KeyRecord, Tier], Handle[Any]],
             landed: Callable[[int], None]) -> None:
        """Start queued requests while in-flight bytes stay under the limit (one always may start).

        Requests for keys that are gone, busy, already there or in use elsewhere are dropped (one
        already there and released is marked prefetched, as if just brought), except
        a key still on its way into HOST that is asked for on DEVICE (the engine's two-level window
        on a GPU): that request waits, without holding up the ones behind it, and starts once the
        first move has landed.
        """
        waiting: list[tuple[str, Tier]] = []
        try:
            while self._queue:
                key, tier = self._queue[0]
                rec = records.get(key)
                if rec is not None and rec.move is not None and rec.move.target == Tier.HOST and tier == Tier.DEVICE:
                    waiting.append(self._queue.popleft())
                    continue
                if rec is None:
                    self._queue.popleft()
                    continue
                there = rec.move is None and rec.state == STABLE[tier]
                if there and not rec.pins:
                    # Claimed as if this prefetch had brought it, so that other prefetches leave it
                    # be until it is used (see `pick_victims` in eviction.py).
                    rec.prefetched = True
                if there or rec.move is not None or rec.pins:
                    self._queue.popleft()
                    continue
                if self.inflight and self.inflight + rec.nbytes > self.limit:
                    return
                self._queue.popleft()
                handle = start(rec, tier)
                if not handle.done():  # a zero-copy hand-over lands at once and holds nothing in flight
                    self.inflight += rec.nbytes
                    handle.add_done_callback(_call_with(landed, rec.nbytes))
        finally:
            self._queue.extendleft(reversed(waiting))


def _call_with(landed: Callable[[int], None], nbytes: int) -> Callable[[Handle[Any]], None]:
    """A done-callback that reports `nbytes` landed (bound now, not when the move ends)."""
    return lambda _handle: landed(nbytes)
