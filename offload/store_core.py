"""What every part of the tiered store shares: the key records, the one lock, the memory tiers,
the swap file, the counters, and the few helpers that change a record's state.

`TieredStore` (store.py) is composed of this core and three parts, each in its own file and all
under the one lock: the movers (moves.py: bring a key into a memory tier), the writes
(writes.py: puts to NVMe, and dirty keys written back behind the caller) and the budgets (budgets.py: room
for a move, by eviction or a bounded wait). See [Note: residency] in residency.py for the states.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future

import torch

from outcore.offload.backends import make_engine
from outcore.offload.background import background_pool
from outcore.offload.buffer_pool import HostBufferPool, PinnedBufferPool
from outcore.offload.buffers import Buffer
from outcore.offload.device_memory import CudaMemory
from outcore.offload.errors import StorageError
from outcore.offload.handle import Handle
from outcore.offload.host_arena import HostArena
from outcore.offload.io_config import IOConfig
from outcore.offload.prefetch import PrefetchQueue
from outcore.offload.residency import TIER_OF, KeyRecord, Residency, Tier
from outcore.offload.swap_file import SwapFile
from outcore.offload.write_back import WriteBackJob, WriteBackWorker

log = logging.getLogger("outcore.offload.store")


class PrefetchDropped(StorageError):
    """A prefetch nobody waits for found no room, or gave way to a fetch: dropped, not an error."""


class StoreCore:
    """The shared state of a `TieredStore`; see the module docstring."""

    # Provided by the parts (moves.py, writes.py, budgets.py), used across them.
    _reserve: Callable[..., Buffer]
    _evict_record: Callable[..., Handle | None]
    _hand_over: Callable[[KeyRecord, Tier], bool]
    _start_move: Callable[..., Future]
    _run_write_back: Callable[[WriteBackJob], None]
    _writer: WriteBackWorker  # started by TieredStore once the core is built

    def __init__(self, nvme_dir: str, device: str | torch.device, device_budget: int, host_budget: int,
                 io: IOConfig | None, *, rank: int, nvme_preallocate: int, prefetch_bytes: int | None,
                 wait_timeout: float) -> None:
        self.device = torch.device(device)
        self.io = io or IOConfig()
        self.wait_timeout = wait_timeout
        on_cuda = self.device.type == "cuda"
        if on_cuda and not torch.cuda.is_available():
            raise ValueError(f"device={self.device} was asked for but CUDA is not available; use device='cpu'.")
        self._host: HostBufferPool | PinnedBufferPool
        self._dev: HostBufferPool | CudaMemory
        if on_cuda:
            self._host, self._dev = PinnedBufferPool(host_budget), CudaMemory(device_budget, self.device)
        else:
            # DEVICE is RAM too: one arena serves both tiers, and a buffer changes tier without a
            # copy (offload/host_arena.py [Note: host arena]).
            arena = HostArena(host_budget + device_budget)
            self._host = HostBufferPool(host_budget, arena=arena)
            self._dev = HostBufferPool(device_budget, name="DEVICE", arena=arena)
        self._mem: dict[Tier, HostBufferPool | PinnedBufferPool | CudaMemory] = {Tier.HOST: self._host,
                                                                               Tier.DEVICE: self._dev}
        self._zero_copy = not on_cuda
        self._engine = make_engine(self.io)
        try:
            self._swap = SwapFile(nvme_dir, rank, self._engine, preallocate=nvme_preallocate)
        except BaseException:
            self._engine.close()
            raise
        self._records: dict[str, KeyRecord] = {}
        self._cond = threading.Condition(threading.RLock())
        self._movers = background_pool(max(4, self.io.threads), "outcore-move", self.io.nice)
        self._clock = itertools.count(1)
        self._counts: Counter[str] = Counter()
        self._freeing = {Tier.HOST: 0, Tier.DEVICE: 0}  # bytes of write-backs in flight, per tier
        self._demand_waiting = {Tier.HOST: 0, Tier.DEVICE: 0}  # requests someone waits for, waiting for room
        # Put and write-back handles still running, or failed and not yet reported by flush():
        # finished ones leave at once, so a long run without flush() holds none of them.
        self._writes: set[Handle] = set()
        self._prefetch = PrefetchQueue(prefetch_bytes if prefetch_bytes is not None
                                       else max(host_budget, device_budget) // 2)
        self._last_writeback_error: BaseException | None = None
        self._closed = False

    def _land(self, rec: KeyRecord, state: Residency,
              old_buffer: tuple[Buffer, Residency] | None = None) -> None:
        """A move arrived: new state, free what the source held, wake whoever waits."""
        rec.to(state)
        rec.move = None
        if old_buffer is not None:
            buf, where = old_buffer
            self._free(TIER_OF[where], buf)
        self._cond.notify_all()

    @property
    def _cuda(self) -> CudaMemory:
        """DEVICE memory on a GPU (only the CUDA paths ask for it)."""
        assert isinstance(self._dev, CudaMemory), "a CUDA path on a CPU-only store"
        return self._dev

    def _track_write(self, handle: Handle) -> None:
        """Keep `handle` for flush() until it has landed (self._cond held)."""
        self._writes.add(handle)

        def landed(h: Handle) -> None:
            if h.exception() is None:
                with self._cond:
                    self._writes.discard(h)

        handle.add_done_callback(landed)

    def _ram(self, tier: Tier) -> HostBufferPool:
        """A memory tier's pool on a CPU-only store, where DEVICE is RAM too (zero-copy paths)."""
        pool = self._mem[tier]
        assert isinstance(pool, HostBufferPool)
        return pool

    def _free(self, tier: Tier, buf: Buffer) -> None:
        with self._cond:
            self._mem[tier].release(buf)
            self._cond.notify_all()

    def _record(self, key: str) -> KeyRecord:
        rec = self._records.get(key)
        if rec is None:
            raise KeyError(f"no key {key!r} in the store; put() it first.")
        return rec

    def _settled(self, key: str, must_exist: bool = False) -> KeyRecord | None:
        """The key's record once no move is in flight; it must not be pinned."""
        deadline = time.monotonic() + self.wait_timeout
        while True:
            rec = self._record(key) if must_exist else self._records.get(key)
            if rec is None or rec.move is None:
                break
            if time.monotonic() > deadline:
                raise StorageError(f"key {key!r} stayed in flight for {self.wait_timeout:.0f} s")
            self._cond.wait(0.05)
        if rec is not None and rec.pins:
            raise ValueError(f"key {key!r} is in use ({rec.pins} fetches not released); release it first.")
        return rec

    def _settled_record(self, key: str) -> KeyRecord:
        """`_settled` of a key that must exist (KeyError otherwise)."""
        rec = self._settled(key, must_exist=True)
        assert rec is not None
        return rec

    def _old_memory(self, old: KeyRecord | None) -> tuple[Buffer, Residency] | None:
        """What a replaced record still held in memory, to free once its successor landed."""
        if old is None or old.buffer is None:
            return None
        return old.buffer, old.state

    def _undo_put(self, rec: KeyRecord, old: KeyRecord | None, error: BaseException) -> None:
        """A put failed before its bytes were in place: the old record (or none) comes back."""
        with self._cond:
            if old is None:
                self._records.pop(rec.key, None)
            else:
                self._records[rec.key] = old
            move, rec.move = rec.move, None
            self._cond.notify_all()
        assert move is not None
        move.future.set_exception(error)  # fetches that chained on the failed put see why

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("the store is closed.")
