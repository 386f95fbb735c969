"""Host memory mapped once and cut into buffers, so that a buffer freed and asked for again costs no
page faults.

[Note: host arena] A store's keys come in a handful of sizes (a unit's shard, an optimizer chunk, a
gradient chunk), and its memory tiers hand out and take back buffers of all of them every step.
Mapping each one afresh made the kernel fault in and zero every page again: most bytes an NVMe
read landed in were zeroed first, only to be overwritten (docs/benchmarks.md). The arena maps
twice its capacity of address space once, lazily, and places buffers at page-aligned extents in
it. It knows which free extents hold pages already touched, and a request takes the smallest
touched one that fits, so freed memory is reused as it is; only when none fits does it take an
untouched one, and only then do pages get faulted in.

The bound: what is in use, what is free but touched, and buffers mapped apart (below) never exceed
`capacity`, the sum of the budgets the arena serves. Before new pages are touched beyond that,
free touched pages go back to the OS (`release_pages`). The extra address space is what keeps
scattered free extents from refusing a large request; should even that not fit, the buffer is
mapped apart, said once in the log, under the same bound.
"""

from __future__ import annotations

import bisect
import errno
import logging
import resource
import threading

import numpy as np

from outcore.offload.aligned import aligned_array, release_pages
from outcore.offload.buffers import HostBuffer
from outcore.offload.errors import StorageError
from outcore.offload.io_config import round_up

log = logging.getLogger(__name__)

ADDRESS_SPACE = 2  # address space mapped per byte of capacity


def _map(capacity: int) -> np.ndarray:
    """The arena's mapping: `ADDRESS_SPACE` times its capacity where the address-space limit
    (`ulimit -v`) allows, else the capacity alone, said once; refused in one clear error where not
    even that fits."""
    for factor in (ADDRESS_SPACE, 1):
        try:
            mapping = aligned_array(factor * capacity)
        except (OSError, MemoryError) as e:
            if isinstance(e, OSError) and e.errno != errno.ENOMEM:
                raise
            continue
        if factor != ADDRESS_SPACE:
            log.warning("the address-space limit (ulimit -v) leaves no room for %s of host arena; it maps its "
                        "capacity alone, so fragmented free memory may refuse a large buffer, which is then mapped "
                        "apart (slower)", f"{ADDRESS_SPACE * capacity:,} bytes")
        return mapping
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    said = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit:,} bytes"
    raise StorageError(f"cannot map {capacity:,} bytes of host memory for the host and device budgets: the "
                       f"address-space limit (ulimit -v: {said}) or the machine refuses it. Lower host_budget "
                       "and device_budget, or raise the limit.")


class ArenaBuffer(HostBuffer):
    """A host buffer at `offset` of a `HostArena` (its array is a view of the arena's mapping)."""

    __slots__ = ("arena", "offset")

    def __init__(self, arena: HostArena, offset: int, array: np.ndarray) -> None:
        self.arena, self.offset = arena, offset
        self._wrap(array, pin=False)


class HostArena:
    """Pageable host memory of at most `capacity` resident bytes, shared by the memory tiers that
    cut buffers from it; thread-safe. See [Note: host arena]."""

    def __init__(self, capacity: int) -> None:
        self.capacity = round_up(max(capacity, 1))
        self._mapping = _map(self.capacity)
        self._lock = threading.Lock()
        # Free runs of the mapping: sorted offsets, and offset -> [length, touched]. Neighbours
        # with the same `touched` are merged.
        self._offsets: list[int] = [0]
        self._runs: dict[int, list] = {0: [len(self._mapping), False]}
        self.in_use = 0
        self.touched_free = 0  # bytes of free runs whose pages may be mapped
        self.apart = 0  # bytes of live buffers mapped apart
        self.first_touched = 0  # bytes handed out from untouched runs, since the start
        self.mapped_apart = 0  # buffers mapped apart, since the start
        self._said_apart = False

    def take(self, capacity: int) -> HostBuffer | None:
        """A buffer of `capacity` bytes (a multiple of 4096), or None where pages that must go
        back to the OS to stay within the capacity cannot."""
        with self._lock:
            offset = self._smallest(capacity, touched=True)
            if offset is None:
                if not self._room_for_new_pages(capacity):
                    return None
                offset = self._smallest(capacity, touched=False)
                if offset is not None:
                    self.first_touched += capacity
            if offset is not None:
                self._cut(offset, capacity)
                self.in_use += capacity
                return ArenaBuffer(self, offset, self._mapping[offset : offset + capacity])
            self.apart += capacity
            self.mapped_apart += 1
            if not self._said_apart:
                self._said_apart = True
                log.info("host memory: free space too scattered for a buffer of %s bytes; mapping it apart",
                         f"{capacity:,}")
        return HostBuffer(capacity)

    def give_back(self, buf: HostBuffer) -> None:
        """`buf` is free; nothing may use its memory any more."""
        with self._lock:
            if isinstance(buf, ArenaBuffer) and buf.arena is self:
                self.in_use -= buf.capacity
                self.touched_free += buf.capacity
                self._insert(buf.offset, buf.capacity, touched=True)
            else:  # mapped apart: unmapped once its last view is gone
                assert not isinstance(buf, ArenaBuffer), "a buffer goes back to the arena it was cut from"
                self.apart -= buf.capacity
                assert self.apart >= 0, "a buffer this arena did not map apart"

    def trim(self) -> None:
        """Give the pages of every free run back to the OS."""
        with self._lock:
            self._release(self.touched_free)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"capacity": self.capacity, "in_use": self.in_use, "touched_free": self.touched_free,
                    "apart": self.apart, "first_touched": self.first_touched, "mapped_apart": self.mapped_apart}

    # -- internals (lock held) --------------------------------------------------------------------

    def _room_for_new_pages(self, capacity: int) -> bool:
        over = self.in_use + self.touched_free + self.apart + capacity - self.capacity
        return over <= 0 or self._release(over)

    def _smallest(self, capacity: int, *, touched: bool) -> int | None:
        """The offset of the smallest free run of this kind that holds `capacity` (the lowest
        among equals), or None."""
        best, best_len = None, None
        for off in self._offsets:
            length, kind = self._runs[off]
            if kind == touched and length >= capacity and (best_len is None or length < best_len):
                best, best_len = off, length
        return best

    def _cut(self, offset: int, capacity: int) -> None:
        """Take [offset, offset + capacity) from the free run that starts at `offset`."""
        length, touched = self._runs.pop(offset)
        self._offsets.pop(bisect.bisect_left(self._offsets, offset))
        if touched:
            self.touched_free -= capacity
        if length > capacity:
            self._add(offset + capacity, length - capacity, touched)

    def _insert(self, offset: int, length: int, *, touched: bool) -> None:
        """A free run, merged with free neighbours of the same kind."""
        i = bisect.bisect_left(self._offsets, offset)
        if i < len(self._offsets):
            right = self._offsets[i]
            assert right >= offset + length, "freed twice"
            if right == offset + length and self._runs[right][1] == touched:
                length += self._runs.pop(right)[0]
                self._offsets.pop(i)
        if i > 0:
            left = self._offsets[i - 1]
            left_len, left_kind = self._runs[left]
            assert left + left_len <= offset, "freed twice"
            if left + left_len == offset and left_kind == touched:
                self._runs.pop(left)
                self._offsets.pop(i - 1)
                offset, length = left, left_len + length
        self._add(offset, length, touched)

    def _add(self, offset: int, length: int, touched: bool) -> None:
        bisect.insort(self._offsets, offset)
        self._runs[offset] = [length, touched]

    def _release(self, nbytes: int) -> bool:
        """Give back at least `nbytes` of free touched pages, from the largest runs' ends; False
        if the OS refuses (nothing then changes)."""
        base = self._mapping.ctypes.data
        runs = sorted(((self._runs[o][0], o) for o in self._offsets if self._runs[o][1]), reverse=True)
        for length, off in runs:
            if nbytes <= 0:
                break
            part = min(length, round_up(nbytes))
            start = off + length - part
            if not release_pages(base + start, part):
                return False
            self._runs.pop(off)
            self._offsets.pop(bisect.bisect_left(self._offsets, off))
            if part < length:
                self._add(off, length - part, True)
            self.touched_free -= part
            self._insert(start, part, touched=False)
            nbytes -= part
        return nbytes <= 0
