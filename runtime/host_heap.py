"""Keep glibc from hoarding the large buffers the engine frees every step.

glibc serves large allocations with mmap and returns them on free, but after each such free it
raises its threshold (up to 32 MiB), so later unit-sized buffers come from the heap and stay in
the process after they are freed: peak RSS then depends on timing, not on the budgets (measured:
1.1 to 1.6 GiB for the same run). Pinning the threshold keeps every buffer of 4 MiB or more
mmapped, so it is returned the moment it is freed. A user who sets MALLOC_MMAP_THRESHOLD_ keeps
their own setting.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # from glibc's malloc.h
_done = False


def pin_mmap_threshold(nbytes: int = 4 << 20) -> bool:
    """Once per process, on glibc; True if the threshold is now pinned."""
    global _done
    if _done or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    _done = True
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = bool(libc.mallopt(M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):  # not glibc
        return False
    if ok:
        log.info("glibc mmap threshold pinned at %d bytes: freed unit buffers return to the OS", nbytes)
    return ok
