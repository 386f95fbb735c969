"""Asynchronous file I/O: worker threads issuing os.preadv/os.pwritev in `block_size` chunks.

A request (one buffer, one file range) is split into blocks; at most `queue_depth` blocks are queued
or running at once over `threads` workers. preadv/pwritev and the block checksum release the GIL, so the
workers run truly in parallel with each other and with the caller.

[Note: reads first] Queued reads are served before queued writes. A read is a fetch someone will
wait for (compute, or the update pipeline); a write is a write-back nobody waits for until its memory
is wanted. In FIFO order a unit's parameters, fetched for the next forward, queued behind the
hundreds of MiB of optimizer states written back at the end of backward. Writes hold at most half
the `queue_depth` slots, so a read never waits for a slot behind a wall of writes either. With more
than one worker, one of them takes writes first: a write-back is also what frees the memory a
waiting fetch needs, and with every worker on reads (a forward's prefetch and the update pipeline
read without pause) such a fetch waited seconds for it.

Alignment (O_DIRECT): the buffer's address, the file offset and the length must be multiples of
4096. The store guarantees it (page-aligned `HostBuffer`s, page-aligned extents, padded lengths).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from outcore.offload.background import lower_priority
from outcore.offload.checksum import block_checksum
from outcore.offload.handle import Handle
from outcore.offload.io_config import IOConfig
from outcore.offload.scratch_dir import open_private

log = logging.getLogger(__name__)

_warned_buffered: set[str] = set()


class ShortIOError(OSError):
    """The file ended before a read or write finished: the file is truncated."""


@dataclass(frozen=True, slots=True)
class IOFile:
    """An open file and how it was opened."""

    path: str
    fd: int
    direct: bool

    def close(self) -> None:
        os.close(self.fd)


def _open_direct(path: str, flags: int) -> int:
    # One place that asks for O_DIRECT, so tests can stand in for a filesystem that refuses it.
    return os.open(path, flags | os.O_DIRECT, 0o600)


def open_io_file(path: str, *, direct: bool, create: bool = True, truncate: bool = False,
                 private: bool = False) -> IOFile:
    """Open `path` read-write, with O_DIRECT when asked and allowed; else buffered, said once.
    `private`: never through a symbolic link, and only a regular file of ours (scratch_dir.py)."""
    flags = os.O_RDWR | (os.O_CREAT if create else 0) | (os.O_TRUNC if truncate else 0)
    if private:
        check = open_private(path, flags & ~os.O_TRUNC)  # refused before a byte is truncated
        os.close(check)
        flags |= os.O_NOFOLLOW
    if direct:
        try:
            return IOFile(path, _open_direct(path, flags), True)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            folder = os.path.dirname(os.path.abspath(path))
            if folder not in _warned_buffered:
                _warned_buffered.add(folder)
                log.warning("O_DIRECT is not supported in %s (tmpfs?); using buffered I/O there, "
                            "which goes through the page cache", folder)
    return IOFile(path, os.open(path, flags, 0o600), False)


Finalizer = Callable[["IOHandle", BaseException | None], None]
"""Runs in the completing thread before the handle is done; what it raises becomes the handle's error."""


class IOHandle(Handle[None]):
    """Completion of one request; per-block checksums are in `crcs` when checksums were asked for."""

    __slots__ = ("crcs", "nbytes", "_remaining", "_first_error", "_finalize", "_block_lock")

    def __init__(self, nblocks: int, nbytes: int, finalize: Finalizer | None) -> None:
        super().__init__()
        self.crcs = [0] * nblocks
        self.nbytes = nbytes
        self._remaining = nblocks
        self._first_error: BaseException | None = None
        self._finalize = finalize
        self._block_lock = threading.Lock()
        if nblocks == 0:
            self._finish()

    def block_done(self, index: int, crc: int, error: BaseException | None) -> None:
        with self._block_lock:
            self.crcs[index] = crc
            if error is not None and self._first_error is None:
                self._first_error = error
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        error = self._first_error
        if self._finalize is not None:
            try:
                self._finalize(self, error)  # may raise: translates an error, or finds one (bad checksum)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter, never swallowed
                error = e
        self.set_done(error)


class IOCounters:
    """Bytes moved, and seconds during which at least one read or write call was running: the
    disk's busy time. A block's checksum is CPU work beside the call and is not counted in it."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self.bytes_written = 0
        self.busy_seconds = 0.0
        self._active = 0
        self._since = 0.0
        self._lock = threading.Lock()

    def begin(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = time.perf_counter()
            self._active += 1

    def end(self, nbytes: int, write: bool) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self.busy_seconds += time.perf_counter() - self._since
            if write:
                self.bytes_written += nbytes
            else:
                self.bytes_read += nbytes

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            busy = self.busy_seconds + (time.perf_counter() - self._since if self._active else 0.0)
            return {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written, "io_busy_seconds": busy}


def _pread_full(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise ShortIOError(errno.EIO, f"file ends at {offset:,}, {len(view):,} bytes short")
        view, offset = view[n:], offset + n


def _pwrite_full(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwritev(fd, [view], offset)
        if n == 0:
            raise ShortIOError(errno.EIO, f"write at {offset:,} made no progress")
        view, offset = view[n:], offset + n


class IOEngine(ABC):
    """An I/O backend: reads and writes of whole arrays in `block_size` blocks, each one handle.
    A backend says how a block goes to the file (`_submit`)."""

    config: IOConfig
    counters: IOCounters

    def read(self, file: IOFile, offset: int, array: np.ndarray, *, checksum: bool = False,
             finalize: Finalizer | None = None) -> IOHandle:
        """Read len(array) bytes at `offset` into `array` (uint8)."""
        return self._submit(False, file, offset, array, checksum, finalize)

    def write(self, file: IOFile, offset: int, array: np.ndarray, *, checksum: bool = False,
              finalize: Finalizer | None = None) -> IOHandle:
        """Write `array` (uint8) at `offset`; `array` must stay untouched until the handle is done."""
        return self._submit(True, file, offset, array, checksum, finalize)

    @abstractmethod
    def close(self) -> None:
        """Finish the I/O under way and stop."""

    @abstractmethod
    def _submit(self, write: bool, file: IOFile, offset: int, array: np.ndarray, checksum: bool,
                finalize: Finalizer | None) -> IOHandle:
        """Start the blocks of one read or write; the handle completes when the last has."""


class ThreadIOEngine(IOEngine):
    """The default backend: a fixed pool of threads doing positional, vectored reads and writes."""

    def __init__(self, config: IOConfig) -> None:
        self.config = config
        self.counters = IOCounters()
        self._slots = threading.BoundedSemaphore(config.queue_depth)
        self._write_slots = threading.BoundedSemaphore(max(1, config.queue_depth // 2))
        self._queued: dict[bool, deque[tuple]] = {False: deque(), True: deque()}  # write? -> blocks waiting
        self._ready = threading.Condition()
        self._closing = False
        self._workers = [threading.Thread(target=self._work, args=(0 < i == config.threads - 1,),
                                          name=f"outcore-io-{i}", daemon=True) for i in range(config.threads)]
        for w in self._workers:
            w.start()

    def close(self) -> None:
        with self._ready:
            self._closing = True
            self._ready.notify_all()
        for w in self._workers:
            w.join()

    def _submit(self, write: bool, file: IOFile, offset: int, array: np.ndarray, checksum: bool,
                finalize: Finalizer | None) -> IOHandle:
        bs = self.config.block_size
        n = len(array)
        handle = IOHandle(-(-n // bs), n, finalize)
        view = memoryview(array)  # type: ignore[arg-type]  # numpy arrays export the buffer protocol
        for i, start in enumerate(range(0, n, bs)):
            if write:
                self._write_slots.acquire()  # [Note: reads first]
            self._slots.acquire()  # back-pressure: at most queue_depth blocks in flight
            with self._ready:
                self._queued[write].append((handle, i, write, file.fd, offset + start, view[start : start + bs],
                                            checksum))
                self._ready.notify()
        return handle

    def _next_block(self, writes_first: bool) -> tuple | None:
        """The oldest queued read, else the oldest queued write (the other way round for the
        worker that takes `writes_first`); None once closed and drained."""
        with self._ready:
            while not (self._queued[False] or self._queued[True] or self._closing):
                self._ready.wait()
            for kind in ((True, False) if writes_first else (False, True)):
                if self._queued[kind]:
                    return self._queued[kind].popleft()
            return None

    def _work(self, writes_first: bool) -> None:
        lower_priority(self.config.nice)
        while (item := self._next_block(writes_first)) is not None:
            handle, index, write, fd, offset, view, checksum = item
            crc, error = 0, None
            try:
                if write and checksum:
                    crc = block_checksum(view)
                self.counters.begin()
                try:
                    (_pwrite_full if write else _pread_full)(fd, view, offset)
                finally:
                    self.counters.end(len(view), write)
                if checksum and not write:
                    crc = block_checksum(view)
            except OSError as e:
                error = e
            finally:
                self._slots.release()
                if write:
                    self._write_slots.release()
            handle.block_done(index, crc, error)
            # Hold no view of the buffer while idle: a buffer the pool drops is then unmapped at
            # once, not when this worker's next block comes, so RSS stays within the budgets.
            del item, handle, view
