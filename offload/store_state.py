"""What the parts of the tiered store share: the key records and the one lock over them, the memory
tiers, the swap file, the counters, and the few steps that change a record's state.

`TieredStore` (store.py) composes this state with three parts, each its own object built on it:
the room (room.py: room for a move, by eviction or a bounded wait), the writer (writer.py: puts
to NVMe, and dirty keys written back behind the caller) and the mover (mover.py: bring a key into
a memory tier). Each part changes records only under `cond`. See [Note: residency] in
residency.py for the states.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from typing import Any

import torch

from outcore.offload.backends import make_engine
from outcore.offload.buffer_pool import HostBufferPool, PinnedBufferPool
from outcore.offload.buffers import Buffer
from outcore.offload.device_memory import CudaMemory
from outcore.offload.errors import StorageError
from outcore.offload.handle import Handle
from outcore.offload.host_arena import HostArena
from outcore.offload.io_config import IOConfig
from outcore.offload.prefetch import PrefetchQueue
from outcore.offload.residency import STABLE, TIER_OF, KeyRecord, Residency, Tier
from outcore.offload.swap_file import SwapFile


class PrefetchDropped(StorageError):
    """A prefetch nobody waits for found no room, or gave way to a fetch: dropped, not an error."""


class StoreState:
    """The records, the lock, the tiers and the counters of one `TieredStore`."""

    def __init__(self, nvme_dir: str, device: str | torch.device, device_budget: int, host_budget: int,
                 io: IOConfig | None, *, rank: int, nvme_preallocate: int, prefetch_bytes: int | None,
                 wait_timeout: float) -> None:
        self.device = torch.device(device)
        self.io = io or IOConfig()
        self.wait_timeout = wait_timeout
        on_cuda = self.device.type == "cuda"
        if on_cuda and not torch.cuda.is_available():
            raise ValueError(f"device={self.device} was asked for but CUDA is not available; use device='cpu'.")
        self.host: HostBufferPool | PinnedBufferPool
        self.dev: HostBufferPool | CudaMemory
        if on_cuda:
            self.host, self.dev = PinnedBufferPool(host_budget), CudaMemory(device_budget, self.device)
        else:
            # DEVICE is RAM too: one arena serves both tiers, and a buffer changes tier without a
            # copy (offload/host_arena.py [Note: host arena]).
            arena = HostArena(host_budget + device_budget)
            self.host = HostBufferPool(host_budget, arena=arena)
            self.dev = HostBufferPool(device_budget, name="DEVICE", arena=arena)
        self.mem: dict[Tier, HostBufferPool | PinnedBufferPool | CudaMemory] = {Tier.HOST: self.host,
                                                                              Tier.DEVICE: self.dev}
        self.zero_copy = not on_cuda
        self.engine = make_engine(self.io)
        try:
            self.swap = SwapFile(nvme_dir, rank, self.engine, preallocate=nvme_preallocate)
        except BaseException:
            self.engine.close()
            raise
        self.records: dict[str, KeyRecord] = {}
        self.cond = threading.Condition(threading.RLock())
        self.clock = itertools.count(1)
        self.counts: Counter[str] = Counter()
        self.freeing = {Tier.HOST: 0, Tier.DEVICE: 0}  # bytes of write-backs in flight, per tier
        self.demand_waiting = {Tier.HOST: 0, Tier.DEVICE: 0}  # requests someone waits for, waiting for room
        # Put and write-back handles still running, or failed and not yet reported by flush():
        # finished ones leave at once, so a long run without flush() holds none of them.
        self.writes: set[Handle[None]] = set()
        self.prefetch = PrefetchQueue(prefetch_bytes if prefetch_bytes is not None
                                      else max(host_budget, device_budget) // 2)
        self.last_writeback_error: BaseException | None = None
        self.closed = False

    # -- memory ----------------------------------------------------------------------------------

    @property
    def cuda(self) -> CudaMemory:
        """DEVICE memory on a GPU (only the CUDA paths ask for it)."""
        assert isinstance(self.dev, CudaMemory), "a CUDA path on a CPU-only store"
        return self.dev

    def ram(self, tier: Tier) -> HostBufferPool:
        """A memory tier's pool on a CPU-only store, where DEVICE is RAM too (zero-copy paths)."""
        pool = self.mem[tier]
        assert isinstance(pool, HostBufferPool)
        return pool

    def free(self, tier: Tier, buf: Buffer) -> None:
        with self.cond:
            self.mem[tier].release(buf)
            self.cond.notify_all()

    def hand_over(self, rec: KeyRecord, tier: Tier) -> bool:
        """CPU-only HOST <-> DEVICE: move the buffer's accounting, not its bytes (cond held)."""
        src, dst = self.ram(rec.stable_tier), self.ram(tier)
        if rec.held.capacity > dst.budget or not dst.try_adopt(rec.held):
            return False
        src.detach(rec.held)
        rec.to(STABLE[tier])
        self.cond.notify_all()
        return True

    # -- records ---------------------------------------------------------------------------------

    def land(self, rec: KeyRecord, state: Residency, old_buffer: tuple[Buffer, Residency] | None = None) -> None:
        """A move arrived: new state, free what the source held, wake whoever waits (cond held)."""
        rec.to(state)
        rec.move = None
        if old_buffer is not None:
            buf, where = old_buffer
            self.free(TIER_OF[where], buf)
        self.cond.notify_all()

    def track_write(self, handle: Handle[None]) -> None:
        """Keep `handle` for flush() until it has landed (cond held)."""
        self.writes.add(handle)

        def landed(h: Handle[None]) -> None:
            if h.exception() is None:
                with self.cond:
                    self.writes.discard(h)

        handle.add_done_callback(landed)

    def record(self, key: str) -> KeyRecord:
        rec = self.records.get(key)
        if rec is None:
            raise KeyError(f"no key {key!r} in the store; put() it first.")
        return rec

    def settled(self, key: str, must_exist: bool = False) -> KeyRecord | None:
        """The key's record once no move is in flight; it must not be pinned (cond held)."""
        deadline = time.monotonic() + self.wait_timeout
        while True:
            rec = self.record(key) if must_exist else self.records.get(key)
            if rec is None or rec.move is None:
                break
            if time.monotonic() > deadline:
                raise StorageError(f"key {key!r} stayed in flight for {self.wait_timeout:.0f} s")
            self.cond.wait(0.05)
        if rec is not None and rec.pins:
            raise ValueError(f"key {key!r} is in use ({rec.pins} fetches not released); release it first.")
        return rec

    def settled_record(self, key: str) -> KeyRecord:
        """`settled` of a key that must exist (KeyError otherwise)."""
        rec = self.settled(key, must_exist=True)
        assert rec is not None
        return rec

    def old_memory(self, old: KeyRecord | None) -> tuple[Buffer, Residency] | None:
        """What a replaced record still held in memory, to free once its successor landed."""
        if old is None or old.buffer is None:
            return None
        return old.buffer, old.state

    def undo_put(self, rec: KeyRecord, old: KeyRecord | None, error: BaseException) -> None:
        """A put failed before its bytes were in place: the old record (or none) comes back."""
        with self.cond:
            if old is None:
                self.records.pop(rec.key, None)
            else:
                self.records[rec.key] = old
            move, rec.move = rec.move, None
            self.cond.notify_all()
        assert move is not None
        move.handle.set_exception(error)  # fetches that chained on the failed put see why

    def check_open(self) -> None:
        if self.closed:
            raise StorageError("the store is closed.")

    def stats(self) -> dict:
        """`TieredStore.stats()`: bytes per tier, I/O totals and seconds, fetch and prefetch counts."""
        with self.cond:
            resident: Counter[str] = Counter()
            for rec in self.records.values():
                if rec.tier is not None and rec.tier != Tier.NVME:
                    resident[rec.tier.name.lower()] += rec.nbytes
            out: dict[str, Any] = {
                "device": {"budget": self.dev.budget, "in_use": self.dev.in_use, "cached": self.dev.cached,
                           "peak": self.dev.peak, "resident": resident["device"]},
                "host": {"budget": self.host.budget, "in_use": self.host.in_use, "cached": self.host.cached,
                         "peak": self.host.peak, "resident": resident["host"]},
                "nvme": {"bytes": self.swap.used, "file_bytes": self.swap.capacity, "direct": self.swap.direct},
                # CPU-only: the memory both tiers are cut from (offload/host_arena.py)
                "arena": self.host.arena.stats() if isinstance(self.host, HostBufferPool) else None,
                "keys": len(self.records),
                "writes_pending": len(self.writes),
                "writes_failed": self.counts["writes_failed"],
            }
            counts = dict(self.counts)
        out.update(self.engine.counters.snapshot())
        for name in ("fetches", "hits", "misses", "prefetch_issued", "prefetch_hits", "prefetch_late",
                     "prefetch_dropped", "evictions", "writebacks"):
            out[name] = counts.get(name, 0)
        out["prefetch_misses"] = out["misses"]
        return out
