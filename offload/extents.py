"""Space inside one swap file: page-aligned extents, first-fit, freed space reused and coalesced."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from outcore.offload.io_config import PAGE, round_up


@dataclass(frozen=True, slots=True)
class Extent:
    """`length` bytes at `offset` of a swap file; both multiples of 4096."""

    offset: int
    length: int


class ExtentAllocator:
    """Hands out extents of a file that grows at its end; not thread-safe (the swap file locks)."""

    def __init__(self) -> None:
        self.end = 0  # bytes of the file in use or on the free list
        self._free_offsets: list[int] = []  # sorted
        self._free_length: dict[int, int] = {}  # offset -> length of each free run
        self.used = 0

    def allocate(self, nbytes: int) -> Extent:
        """First fit among freed runs, else at the end (the caller grows the file to `self.end`)."""
        length = round_up(max(nbytes, 1), PAGE)
        for i, off in enumerate(self._free_offsets):
            run = self._free_length[off]
            if run >= length:
                del self._free_offsets[i]
                del self._free_length[off]
                if run > length:
                    self._insert(off + length, run - length)
                self.used += length
                return Extent(off, length)
        ext = Extent(self.end, length)
        self.end += length
        self.used += length
        return ext

    def free(self, ext: Extent) -> None:
        """Give `ext` back, merging it with free neighbours; a run at the end shrinks the end."""
        self.used -= ext.length
        off, length = ext.offset, ext.length
        i = bisect.bisect_left(self._free_offsets, off)
        assert i == len(self._free_offsets) or self._free_offsets[i] >= off + length, "double free"
        if i < len(self._free_offsets) and self._free_offsets[i] == off + length:  # merge right
            nxt = self._free_offsets.pop(i)
            length += self._free_length.pop(nxt)
        if i > 0:  # merge left
            prev = self._free_offsets[i - 1]
            assert prev + self._free_length[prev] <= off, "double free"
            if prev + self._free_length[prev] == off:
                self._free_offsets.pop(i - 1)
                off, length = prev, self._free_length.pop(prev) + length
        if off + length == self.end:
            self.end = off
        else:
            self._insert(off, length)

    def free_runs(self) -> list[Extent]:
        return [Extent(o, self._free_length[o]) for o in self._free_offsets]

    def _insert(self, off: int, length: int) -> None:
        bisect.insort(self._free_offsets, off)
        self._free_length[off] = length
