"""Write-backs: a dirty key written to NVMe behind its owner, by one writer thread, in order.

`WriteBackJob` is one write-back's record; `WriteBackWorker` is the thread that issues them, by
calling the store writer's `_run_write_back` (writer.py) for each.

[Note: no I/O under the lock] Write-backs are queued to the writer thread, never issued by a thread
that holds the store lock: such a thread must never wait for an I/O slot, because I/O completions
take the lock to land.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from outcore.offload.background import lower_priority
from outcore.offload.buffers import Buffer, HostBuffer
from outcore.offload.residency import KeyRecord, Move, Tier


@dataclass(frozen=True, slots=True, eq=False)
class WriteBackJob:
    """One write-back: `record`'s bytes in `buffer` (in `tier`) to NVMe as part of `move`;
    `staging`: the pinned HOST buffer a CUDA buffer is copied down to first (None from HOST)."""

    record: KeyRecord
    move: Move
    tier: Tier
    buffer: Buffer
    staging: HostBuffer | None

    @property
    def source(self) -> HostBuffer:
        """The buffer the swap file is written from."""
        source = self.staging or self.buffer
        assert isinstance(source, HostBuffer)
        return source


class WriteBackWorker:
    """The writer thread: runs each submitted job, in submission order, at a lower priority."""

    def __init__(self, run: Callable[[WriteBackJob], None], nice: int) -> None:
        self._run, self._nice = run, nice
        self._queue: queue.SimpleQueue[WriteBackJob | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="outcore-writer", daemon=True)
        self._thread.start()

    def submit(self, job: WriteBackJob) -> None:
        self._queue.put(job)

    def close(self) -> None:
        """Run what was submitted, then stop."""
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        lower_priority(self._nice)
        while (job := self._queue.get()) is not None:
            self._run(job)
