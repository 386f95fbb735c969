"""A bounded pool of page-aligned host buffers, reused rather than reallocated.

[Note: pool accounting] `in_use + cached <= budget` always holds. `in_use` counts buffers handed
out (or adopted from another pool); `cached` counts freed buffers kept for reuse, which are real
memory too. A request that does not fit first drops cached buffers of other sizes, then (in
`acquire`) waits for a release until its deadline.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from outcore.offload.buffers import Buffer, HostBuffer
from outcore.offload.errors import OutOfBudgetError
from outcore.offload.io_config import round_up


class HostBufferPool:
    """Hands out `HostBuffer`s whose total capacity never exceeds `budget` bytes."""

    def __init__(self, budget: int, *, pin: bool = False, name: str = "HOST") -> None:
        if budget < 0:
            raise ValueError(f"{name.lower()}_budget={budget} must be >= 0.")
        self.budget = budget
        self.pin = pin
        self.name = name
        self.in_use = 0
        self.cached = 0
        self.peak = 0
        self.allocations = 0  # fresh mmaps, to show that reuse works
        self._free: OrderedDict[int, list[HostBuffer]] = OrderedDict()  # capacity -> buffers, LRU first
        self._cond = threading.Condition()

    def try_acquire(self, nbytes: int) -> HostBuffer | None:
        """A buffer of at least `nbytes`, or None when the budget has no room now."""
        capacity = round_up(max(nbytes, 1))
        self._check_fits(capacity)
        with self._cond:
            same = self._free.get(capacity)
            if same:
                buf = same.pop()
                if not same:
                    del self._free[capacity]
                self.cached -= capacity
                self._charge(capacity)
                return buf
            if not self._make_room(capacity):
                return None
            self._charge(capacity)
        self.allocations += 1
        return HostBuffer(capacity, pin=self.pin)

    def acquire(self, nbytes: int, timeout: float = 30.0) -> HostBuffer:
        """Like `try_acquire`, but waits up to `timeout` seconds for a release."""
        deadline = time.monotonic() + timeout
        while True:
            buf = self.try_acquire(nbytes)
            if buf is not None:
                return buf
            with self._cond:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OutOfBudgetError(self.name, round_up(max(nbytes, 1)), self.budget,
                                           f"{self.in_use:,} bytes stayed in use for {timeout:.0f} s.")
                self._cond.wait(min(left, 0.1))

    def release(self, buf: Buffer) -> None:
        """Return `buf` for reuse; the caller must hold no view of it any more."""
        assert isinstance(buf, HostBuffer), "a host pool takes back host buffers only"
        with self._cond:
            assert self.in_use >= buf.capacity, "released a buffer this pool does not account for"
            self.in_use -= buf.capacity
            self.cached += buf.capacity
            self._free.setdefault(buf.capacity, []).append(buf)
            self._free.move_to_end(buf.capacity)
            self._cond.notify_all()

    def detach(self, buf: Buffer) -> None:
        """Stop accounting for `buf`: its ownership moves to another pool (zero-copy tier move)."""
        with self._cond:
            assert self.in_use >= buf.capacity
            self.in_use -= buf.capacity
            self._cond.notify_all()

    def try_adopt(self, buf: Buffer) -> bool:
        """Start accounting for a buffer another pool detached; False when there is no room."""
        self._check_fits(buf.capacity)
        with self._cond:
            if not self._make_room(buf.capacity):
                return False
            self._charge(buf.capacity)
            return True

    def available(self) -> int:
        """Bytes a request could get now without waiting (cached buffers count as free)."""
        with self._cond:
            return self.budget - self.in_use

    def trim(self) -> None:
        """Drop every cached buffer (gives the memory back to the OS)."""
        with self._cond:
            self._drop_cached(self.cached)

    def close(self) -> None:
        self.trim()

    # -- internals (self._cond held) --------------------------------------------------------------

    def _check_fits(self, capacity: int) -> None:
        if capacity > self.budget:
            raise OutOfBudgetError(self.name, capacity, self.budget, "A single buffer is larger than the whole budget.")

    def _charge(self, capacity: int) -> None:
        self.in_use += capacity
        self.peak = max(self.peak, self.in_use + self.cached)
        assert self.in_use + self.cached <= self.budget, "[Note: pool accounting] violated"

    def _make_room(self, capacity: int) -> bool:
        if self.in_use + capacity > self.budget:
            return False
        self._drop_cached(self.in_use + self.cached + capacity - self.budget)
        return True

    def _drop_cached(self, nbytes: int) -> None:
        while nbytes > 0 and self._free:
            capacity, bufs = next(iter(self._free.items()))
            bufs.pop().free()
            if not bufs:
                del self._free[capacity]
            self.cached -= capacity
            nbytes -= capacity
