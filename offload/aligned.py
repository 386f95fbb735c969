"""Page-aligned host memory without torch (so `outcore bench-disk` stays light)."""

from __future__ import annotations

import mmap

import numpy as np

from offload.io_config import PAGE, round_up


def aligned_array(nbytes: int) -> np.ndarray:
    """A zero-filled uint8 array of `nbytes` rounded up to a page, at a page-aligned address.

    It comes from anonymous mmap: pages are touched lazily, and the mapping returns to the OS when
    the last array viewing it is gone (glibc's heap never holds it).
    """
    m = mmap.mmap(-1, round_up(max(nbytes, 1)))
    arr = np.frombuffer(m, dtype=np.uint8)  # keeps the mapping alive
    assert arr.ctypes.data % PAGE == 0
    return arr
