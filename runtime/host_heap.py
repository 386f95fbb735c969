"""Keep glibc from hoarding the large buffers the engine frees every step, without making torch's
own activations and gradients fresh mappings every step.

glibc serves large allocations with mmap and returns them on free, but after each such free it
raises its threshold (up to 32 MiB), so later unit-sized buffers come from the heap and stay in
the process after they are freed: peak RSS then depends on timing, not on the budgets
(docs/benchmarks.md). Pinning the threshold keeps every buffer above it mmapped, so it
is returned the moment it is freed.

Below the threshold, buffers come from the heap and are reused as they are: a buffer mmapped
afresh is faulted in and zeroed again, page by page, each time. Activations and weight gradients
of a few MiB are allocated and freed every step, so a low threshold costs a step its page faults,
and a high one costs the heap's retained free chunks (both measured in docs/benchmarks.md). So the engine
pins 16 MiB, and 4 MiB where the budgets in host RAM total under 1 GiB, where memory is what the
user asked to save. A user who sets MALLOC_MMAP_THRESHOLD_ keeps their own setting.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # from glibc's malloc.h
LEAN_BUDGETS = 1 << 30  # budgets in host RAM below this total keep the lower threshold
LEAN_THRESHOLD, THRESHOLD = 4 << 20, 16 << 20
_done = False


def mmap_threshold_for(budgets_in_ram: int) -> int:
    """The threshold for an engine whose budgets in host RAM (HOST, and DEVICE on a CPU-only
    machine) total `budgets_in_ram` bytes."""
    return LEAN_THRESHOLD if budgets_in_ram < LEAN_BUDGETS else THRESHOLD


def pin_mmap_threshold(nbytes: int) -> bool:
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
        log.info("glibc mmap threshold pinned at %d MiB: freed buffers above it return to the OS at once",
                 nbytes >> 20)
    return ok
