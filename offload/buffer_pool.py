"""Bounded pools of page-aligned host buffers, reused rather than reallocated.

[Note: pool accounting] `in_use + cached <= budget` always holds. `in_use` counts buffers handed
out (or adopted from another pool); `cached` counts freed buffers a pool keeps for itself, which
are real memory too. A request that does not fit waits (in `acquire`) for a release until its
deadline.

Two kinds, one interface:
- `HostBufferPool`: pageable memory cut from a `HostArena` (offload/host_arena.py), which it may
  share with another pool (on a CPU-only machine, DEVICE and HOST are one arena: a buffer changes
  tier without a copy and goes back to the same free space). It caches nothing itself;
- `PinnedBufferPool`: page-locked memory for a GPU's HOST tier, one registration per buffer, freed
  buffers cached by size (registering is slow; a page-locked page cannot be given back without
  unregistering its whole buffer). A request of a size it has none of drops cached buffers of other
  sizes to make room.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict

from outcore.offload.buffers import Buffer, HostBuffer
from outcore.offload.errors import OutOfBudgetError
from outcore.offload.host_arena import ArenaBuffer, HostArena
from outcore.offload.io_config import round_up


class ByteBudget:
    """A tier's byte budget and what is charged to it ([Note: pool accounting]); its lock is
    `_cond`, which the methods marked so expect held. The host pools and the GPU's memory
    (offload/device_memory.py) keep their bytes on one."""

    def __init__(self, budget: int, *, name: str) -> None:
        if budget < 0:
            raise ValueError(f"{name.lower()}_budget={budget} must be >= 0.")
        self.budget = budget
        self.name = name
        self.in_use = 0
        self.cached = 0
        self.peak = 0
        self._cond = threading.Condition()

    def available(self) -> int:
        """Bytes a request could get now without waiting (cached buffers count as free)."""
        with self._cond:
            return self.budget - self.in_use

    def _check_fits(self, capacity: int) -> None:
        if capacity > self.budget:
            raise OutOfBudgetError(self.name, capacity, self.budget, "A single buffer is larger than the whole budget.")

    def _fits_now(self, capacity: int) -> bool:
        """(`_cond` held)"""
        return self.in_use + capacity <= self.budget

    def _charge(self, capacity: int) -> None:
        """(`_cond` held)"""
        self.in_use += capacity
        self.peak = max(self.peak, self.in_use + self.cached)
        assert self.in_use + self.cached <= self.budget, "[Note: pool accounting] violated"

    def _credit(self, capacity: int) -> None:
        """(`_cond` held)"""
        assert self.in_use >= capacity, "released bytes this budget does not account for"
        self.in_use -= capacity
        self._cond.notify_all()


class _BudgetedPool(ByteBudget, ABC):
    """The budget and its waits; subclasses say where a buffer comes from and where it goes."""

    def try_acquire(self, nbytes: int) -> HostBuffer | None:
        """A buffer of at least `nbytes`, or None when the budget has no room now."""
        capacity = round_up(max(nbytes, 1))
        self._check_fits(capacity)
        with self._cond:
            if not self._fits_now(capacity):
                return None
            buf = self._take(capacity)
            if buf is not None:
                self._charge(capacity)
            return buf

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
            self._credit(buf.capacity)
            self._give(buf)

    def detach(self, buf: Buffer) -> None:
        """Stop accounting for `buf`: its ownership moves to another pool (zero-copy tier move)."""
        with self._cond:
            self._credit(buf.capacity)

    def try_adopt(self, buf: Buffer) -> bool:
        """Start accounting for a buffer another pool detached; False when there is no room."""
        self._check_fits(buf.capacity)
        with self._cond:
            if not self._fits_now(buf.capacity):
                return False
            self._make_room(buf.capacity)
            self._charge(buf.capacity)
            return True

    @abstractmethod
    def trim(self) -> None:
        """Give cached or free memory back to the OS."""

    def close(self) -> None:
        self.trim()

    # -- where buffers come from and go (self._cond held) -----------------------------------------

    @abstractmethod
    def _take(self, capacity: int) -> HostBuffer | None:
        """A buffer of `capacity` bytes from this pool's memory, or None where there is none now."""

    @abstractmethod
    def _give(self, buf: HostBuffer) -> None:
        """`buf` goes back to this pool's memory."""

    @abstractmethod
    def _make_room(self, capacity: int) -> None:
        """Make `capacity` more bytes in use fit beside what the pool caches."""



class HostBufferPool(_BudgetedPool):
    """Pageable host buffers within `budget` bytes, cut from `arena` (a new one of `budget` bytes
    when none is given)."""

    def __init__(self, budget: int, *, name: str = "HOST", arena: HostArena | None = None) -> None:
        super().__init__(budget, name=name)
        self.arena = arena if arena is not None else HostArena(budget)

    def _take(self, capacity: int) -> HostBuffer | None:
        return self.arena.take(capacity)

    def _give(self, buf: HostBuffer) -> None:
        # A buffer adopted from a pool of another arena goes back to the one it was cut from.
        (buf.arena if isinstance(buf, ArenaBuffer) else self.arena).give_back(buf)

    def _make_room(self, capacity: int) -> None:
        """Nothing to drop: the pool caches nothing itself (the arena keeps its budget)."""

    def trim(self) -> None:
        self.arena.trim()


class PinnedBufferPool(_BudgetedPool):
    """Page-locked host buffers within `budget` bytes, freed ones cached by size for reuse."""

    def __init__(self, budget: int, *, name: str = "HOST") -> None:
        super().__init__(budget, name=name)
        self.allocations = 0  # fresh buffers, to show that reuse works
        self._free: OrderedDict[int, list[HostBuffer]] = OrderedDict()  # capacity -> buffers, LRU first

    def _take(self, capacity: int) -> HostBuffer | None:
        same = self._free.get(capacity)
        if same:
            buf = same.pop()
            if not same:
                del self._free[capacity]
            self.cached -= capacity
            return buf
        self._make_room(capacity)
        self.allocations += 1
        return HostBuffer(capacity, pin=True)

    def _give(self, buf: HostBuffer) -> None:
        self.cached += buf.capacity
        self._free.setdefault(buf.capacity, []).append(buf)
        self._free.move_to_end(buf.capacity)

    def _make_room(self, capacity: int) -> None:
        self._drop_cached(self.in_use + self.cached + capacity - self.budget)

    def trim(self) -> None:
        with self._cond:
            self._drop_cached(self.cached)

    def _drop_cached(self, nbytes: int) -> None:
        while nbytes > 0 and self._free:
            capacity, bufs = next(iter(self._free.items()))
            bufs.pop().free()
            if not bufs:
                del self._free[capacity]
            self.cached -= capacity
            nbytes -= capacity
