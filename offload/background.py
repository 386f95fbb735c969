"""Background threads yield the CPU to compute.

The store's I/O, copy and write-back threads and the engine's optimizer thread do work that has
slack: it is prefetched ahead of need or written back behind it. Torch's intra-op threads do not:
on a CPU where compute uses every core, one intra-op thread preempted by a checksum or a copy
stalls the whole parallel region at its barrier, so a little stolen CPU costs a lot of wall time.
Lowering the background threads' priority (`IOConfig.nice`) makes them run in the gaps instead;
when compute does wait on them, its cores are idle and they run at full speed.

Linux gives each thread its own nice value, so this touches only the calling thread. Elsewhere
setpriority would change the whole process, and nothing is done.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)
_warned = False


def lower_priority(nice: int) -> None:
    """Set the calling thread's nice value `nice` above the process's (the main thread's), capped at 19.

    Relative to the process, not to the caller: a thread started by a background thread inherits
    its lowered value, and must not be lowered twice. 0 leaves the thread alone.
    """
    global _warned
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice)
        if os.getpriority(os.PRIO_PROCESS, tid) < target:  # raising it back needs privileges
            os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError as e:  # a sandbox may forbid it; the threads then compete with compute as equals
        if not _warned:
            _warned = True
            log.warning("could not lower background threads' priority (%s); they run at compute's priority", e)


def background_pool(workers: int, name: str, nice: int) -> ThreadPoolExecutor:
    """A thread pool whose threads lower their priority by `nice` as they start."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=lower_priority, initargs=(nice,))
