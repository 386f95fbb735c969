"""Page-aligned host memory without torch (so `outcore bench-disk` stays light).

Large buffers ask the kernel for transparent huge pages: a buffer refilled every step otherwise
costs one page fault per 4 KiB on first touch (measured here: filling a fresh 512 MiB buffer took
0.28-0.33 s and 131,072 faults with 4 KiB pages, 0.07 s and 256 faults with huge pages, 0.04 s when
already mapped). The mapping must be private for that: see `aligned_array`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import numpy as np

from outcore.offload.io_config import PAGE, round_up

HUGE_PAGE = 2 << 20
_MADV_DONTNEED, _MADV_HUGEPAGE = 4, 14  # from linux/mman.h
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
_libc: ctypes.CDLL | bool | None = None


def aligned_array(nbytes: int) -> np.ndarray:
    """A zero-filled uint8 array of `nbytes` rounded up to a page, at a page-aligned address.

    It comes from anonymous mmap: pages are touched lazily, and the mapping returns to the OS when
    the last array viewing it is gone (glibc's heap never holds it).
    """
    # Private, not mmap's default MAP_SHARED: a shared anonymous mapping is shmem, which takes no
    # huge pages unless the machine's shmem_enabled says so (it is "never" by default).
    # MAP_NORESERVE: a host arena maps its whole budget at once and touches it lazily; without it
    # the kernel's overcommit heuristic may refuse a budget near the machine's memory up front.
    m = mmap.mmap(-1, round_up(max(nbytes, 1)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    arr = np.frombuffer(m, dtype=np.uint8)  # keeps the mapping alive
    assert arr.ctypes.data % PAGE == 0
    advise_huge_pages(arr.ctypes.data, arr.nbytes)
    return arr


def advise_huge_pages(address: int, nbytes: int) -> None:
    """Ask for huge pages over the whole 2 MiB pages inside [address, address + nbytes) of memory
    that is not yet touched (Linux; elsewhere, or when refused, nothing changes)."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end > start:
        _madvise(start, end - start, _MADV_HUGEPAGE)


def release_pages(address: int, nbytes: int) -> bool:
    """Give the pages of [address, address + nbytes) (page-aligned) back to the OS, keeping the
    mapping: the next touch reads zeros. False where that cannot be done (no madvise, or refused)."""
    return nbytes <= 0 or _madvise(address, nbytes, _MADV_DONTNEED)


def _madvise(start: int, length: int, advice: int) -> bool:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name) if name else False
    if not isinstance(_libc, ctypes.CDLL) or not hasattr(_libc, "madvise"):
        return False
    return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice) == 0
