"""The NVMe tier of one rank: a preallocated swap file, its extents and its index.

`<dir>/rank<R>.swap` holds the bytes; `<dir>/rank<R>.index.json` (written by `flush`) maps each key
to its offset, length, dtype, shape and checksum. A key is always rewritten into a fresh extent and
the index switched only once the write completed, so a failed write leaves the old bytes and the
old entry intact. A key's present extent may be kept aside (`keep`): later writes of the key then
leave it in place until `drop_kept`, or until `restore_kept` makes it the key's bytes again.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from dataclasses import dataclass

import numpy as np
import torch

from outcore.offload.backends import IOEngine
from outcore.offload.checksum import CHECKSUM_NAME, block_checksum
from outcore.offload.errors import StorageCorruptError, StorageError, StorageFullError
from outcore.offload.extents import Extent, ExtentAllocator
from outcore.offload.io_engine import IOHandle, ShortIOError, open_io_file
from outcore.offload.scratch_dir import DirectoryLock, open_private, prepare_directory

GROW_STEP = 256 << 20  # the file doubles while small, then grows by this much: fallocate stays rare
_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """Where one key's bytes are, and how to check them."""

    extent: Extent
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    checksum: int | None  # checksum over the per-block checksums; None when checksums are off

    def as_json(self) -> dict:
        return {"offset": self.extent.offset, "nbytes": self.nbytes, "dtype": str(self.dtype).removeprefix("torch."),
                "shape": list(self.shape), "checksum": None if self.checksum is None else f"{self.checksum:08x}"}


def combine_crcs(crcs: list[int]) -> int:
    return block_checksum(np.asarray(crcs, dtype="<u4").tobytes())


class SwapFile:
    """One rank's swap file; thread-safe."""

    def __init__(self, directory: str, rank: int, engine: IOEngine, *, preallocate: int = 0) -> None:
        self.directory = prepare_directory(directory)
        self.path = os.path.join(self.directory, f"rank{rank}.swap")
        self.index_path = os.path.join(self.directory, f"rank{rank}.index.json")
        self.rank = rank
        self._engine = engine
        self._checksum = engine.config.checksum
        self._lock_file = DirectoryLock(self.directory, rank)  # before the swap file is touched
        try:
            self.file = open_io_file(self.path, direct=engine.config.direct, truncate=True, private=True)
        except OSError as e:
            self._lock_file.release(remove=True)
            raise StorageError(f"cannot open swap file {self.path!r}: {e.strerror}. "
                               "Check that nvme_dir is writable.") from e
        except BaseException:
            self._lock_file.release(remove=True)
            raise
        self.capacity = 0
        self._alloc = ExtentAllocator()
        self._entries: dict[str, IndexEntry] = {}
        self._kept: dict[str, IndexEntry] = {}  # key -> an earlier entry kept aside (`keep`)
        self._lock = threading.Lock()
        if preallocate:
            with self._lock:
                self._ensure_capacity(preallocate, step=0)

    @property
    def direct(self) -> bool:
        return self.file.direct

    @property
    def used(self) -> int:
        """Bytes held by live keys (and by writes in flight)."""
        with self._lock:
            return self._alloc.used

    def entry(self, key: str) -> IndexEntry | None:
        with self._lock:
            return self._entries.get(key)

    def write(self, key: str, array: np.ndarray, nbytes: int, dtype: torch.dtype,
              shape: tuple[int, ...]) -> IOHandle:
        """Write `array` (page-padded bytes of the key) to a fresh extent; the index follows on success.

        Raises StorageFullError at once when the file cannot grow; `array` must stay untouched until
        the handle completes.
        """
        with self._lock:
            ext = self._alloc.allocate(len(array))
            try:
                self._ensure_capacity(ext.offset + ext.length)
            except StorageFullError:
                self._alloc.free(ext)
                raise

        length = len(array)  # not `array` itself: the buffer must not stay viewed once written

        def finalize(handle: IOHandle, error: BaseException | None) -> None:
            if error is not None:
                with self._lock:
                    self._alloc.free(ext)
                if isinstance(error, OSError) and error.errno in _FULL_ERRNOS:
                    raise StorageFullError(self.directory, length, _free_bytes(self.directory)) from error
                raise StorageError(f"writing key {key!r} to {self.path!r} failed: {error}") from error
            checksum = combine_crcs(handle.crcs) if self._checksum else None
            with self._lock:
                old = self._entries.get(key)
                self._entries[key] = IndexEntry(ext, nbytes, dtype, tuple(shape), checksum)
                self._free_unless_kept(key, old)

        return self._engine.write(self.file, ext.offset, array[: ext.length], checksum=self._checksum,
                                  finalize=finalize)

    def read(self, key: str, array: np.ndarray) -> IOHandle:
        """Read the key's page-padded bytes into `array`; a bad checksum or short file fails the handle."""
        entry = self.entry(key)
        if entry is None:
            raise StorageError(f"key {key!r} has no bytes in {self.path!r}")

        def finalize(handle: IOHandle, error: BaseException | None) -> None:
            if isinstance(error, ShortIOError):
                raise StorageCorruptError(key, self.path, f"the file is truncated ({error.strerror})") from error
            if error is not None:
                raise StorageCorruptError(key, self.path, f"reading failed: {error}") from error
            if entry.checksum is not None and combine_crcs(handle.crcs) != entry.checksum:
                raise StorageCorruptError(key, self.path, "checksum mismatch")

        return self._engine.read(self.file, entry.extent.offset, array[: entry.extent.length],
                                 checksum=entry.checksum is not None, finalize=finalize)

    def discard(self, key: str) -> None:
        """Forget the key and reuse its extent (one kept aside stays kept)."""
        with self._lock:
            self._free_unless_kept(key, self._entries.pop(key, None))

    def keep(self, key: str) -> None:
        """Keep the key's present bytes where they are, whatever is written of it later."""
        with self._lock:
            assert key not in self._kept, f"{key!r} is kept already"
            self._kept[key] = self._entries[key]

    def drop_kept(self, key: str) -> None:
        """The bytes `keep` kept are not wanted any more: their extent is reused."""
        with self._lock:
            kept = self._kept.pop(key)
            if self._entries.get(key) is not kept:
                self._alloc.free(kept.extent)

    def restore_kept(self, key: str) -> None:
        """The bytes `keep` kept are the key's again; those written since are forgotten."""
        with self._lock:
            kept = self._kept.pop(key)
            current = self._entries.get(key)
            if current is not None and current is not kept:
                self._alloc.free(current.extent)
            self._entries[key] = kept

    def _free_unless_kept(self, key: str, entry: IndexEntry | None) -> None:
        """Reuse `entry`'s extent, unless it is the one kept aside for `key` (self._lock held)."""
        if entry is not None and self._kept.get(key) is not entry:
            self._alloc.free(entry.extent)

    def flush(self) -> None:
        """Make completed writes durable and write the index (atomically: temp file + rename)."""
        os.fsync(self.file.fd)
        with self._lock:
            index = {"version": 1, "rank": self.rank, "swap_file": os.path.basename(self.path),
                     "block_size": self._engine.config.block_size,
                     "checksum": f"{CHECKSUM_NAME} of each block's {CHECKSUM_NAME}" if self._checksum else None,
                     "keys": {k: e.as_json() for k, e in self._entries.items()}}
        tmp = self.index_path + ".tmp"
        with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:
            json.dump(index, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.index_path)

    def close(self, *, remove: bool) -> None:
        self.file.close()
        if remove:
            for p in (self.path, self.index_path):
                if os.path.exists(p):
                    os.unlink(p)
        self._lock_file.release(remove=remove)

    def _ensure_capacity(self, end: int, step: int | None = None) -> None:
        """Grow the file to at least `end` bytes with real, allocated blocks (self._lock held)."""
        if end <= self.capacity:
            return
        need = end - self.capacity
        if step is None:
            step = min(GROW_STEP, max(self.capacity, 1 << 20))
        for grow in (max(need, step), need):
            try:
                os.posix_fallocate(self.file.fd, self.capacity, grow)
                self.capacity += grow
                return
            except OSError as e:
                if e.errno not in _FULL_ERRNOS:
                    raise StorageError(f"cannot grow swap file {self.path!r}: {e.strerror}") from e
        raise StorageFullError(self.directory, need, _free_bytes(self.directory))


def _free_bytes(directory: str) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None
