"""The tiered store: keys paged between DEVICE memory, HOST buffers and an NVMe swap file.

Public contract: SPEC.md §1. One `KeyRecord` per key (see [Note: residency] in residency.py);
every state change happens under the store's lock, every byte moves outside it:

- moves that need memory and I/O run on a small pool of mover threads; their future is stored in
  the record, so a second fetch of a moving key joins it instead of moving it twice;
- write-backs and puts are I/O handles whose completion callback lands the new state;
- a budget is never exceeded: a move that needs room evicts released keys (least recently used
  first; clean copies are dropped, dirty ones written back) and waits, bounded, for them to land.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future
from typing import NoReturn

import torch

from outcore.offload.backends import make_engine
from outcore.offload.background import background_pool, lower_priority
from outcore.offload.buffer_pool import HostBufferPool
from outcore.offload.buffers import Buffer, HostBuffer
from outcore.offload.device_memory import CudaMemory
from outcore.offload.errors import OutOfBudgetError, StorageError
from outcore.offload.handle import Handle, done_future, handle_of
from outcore.offload.io_config import IOConfig, round_up
from outcore.offload.prefetch import PrefetchQueue
from outcore.offload.residency import MOVING, STABLE, TIER_OF, KeyRecord, Move, Residency, Tier
from outcore.offload.swap_file import SwapFile

log = logging.getLogger(__name__)


class _PrefetchDropped(StorageError):
    """A prefetch nobody waits for found no room, or gave way to a fetch: dropped, not an error."""


class StagedPut:
    """A put in progress (`TieredStore.stage`): write `tensor`, then `commit()` once or `abort(error)`."""

    def __init__(self, store: TieredStore, record: KeyRecord, old: KeyRecord | None, tier: Tier,
                 buffer: Buffer) -> None:
        self.store, self.record, self.old, self.tier, self.buffer = store, record, old, tier, buffer
        self.tensor = buffer.view(record.nbytes, record.dtype, record.shape)
        self._open = True

    def commit(self) -> Handle:
        assert self._open, "StagedPut committed or aborted twice"
        self._open = False
        return self.store._commit_put(self)

    def abort(self, error: BaseException) -> None:
        if self._open:
            self._open = False
            self.store._free(Tier.HOST if self.tier == Tier.NVME else self.tier, self.buffer)
            self.store._undo_put(self.record, self.old, error)


class TieredStore:
    """Tensors by key, resting on NVMe, HOST or DEVICE, moved asynchronously between them."""

    def __init__(self, nvme_dir: str, device: str | torch.device = "cpu", device_budget: int = 1 << 30,
                 host_budget: int = 1 << 30, io: IOConfig | None = None, *, rank: int = 0,
                 nvme_preallocate: int = 0, prefetch_bytes: int | None = None,
                 wait_timeout: float = 30.0) -> None:
        self.device = torch.device(device)
        self.io = io or IOConfig()
        self.wait_timeout = wait_timeout
        on_cuda = self.device.type == "cuda"
        if on_cuda and not torch.cuda.is_available():
            raise ValueError(f"device={self.device} was asked for but CUDA is not available; use device='cpu'.")
        self._host = HostBufferPool(host_budget, pin=on_cuda, name="HOST")
        # On a CPU-only machine DEVICE is RAM too: its buffers change hands with HOST's, never copied.
        self._dev = CudaMemory(device_budget, self.device) if on_cuda else HostBufferPool(device_budget, name="DEVICE")
        self._mem = {Tier.HOST: self._host, Tier.DEVICE: self._dev}
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
        self._write_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="outcore-writer", daemon=True)
        self._writer.start()
        self._clock = itertools.count(1)
        self._counts: Counter[str] = Counter()
        self._freeing = {Tier.HOST: 0, Tier.DEVICE: 0}  # bytes of write-backs in flight, per tier
        self._demand_waiting = {Tier.HOST: 0, Tier.DEVICE: 0}  # requests someone waits for, waiting for room
        self._writes: set[Handle] = set()  # put and write-back handles flush() has not seen yet
        self._prefetch = PrefetchQueue(prefetch_bytes if prefetch_bytes is not None
                                       else max(host_budget, device_budget) // 2)
        self._last_writeback_error: BaseException | None = None
        self._closed = False

    # -- public API -------------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor, tier: Tier = Tier.NVME, *,
            dtype: torch.dtype | None = None) -> Handle:
        """Store a copy of `tensor` under `key` in `tier`; the copy is taken before put returns.
        With `dtype`, the copy is converted to it on the way in (no intermediate tensor).

        To NVME the write is asynchronous (the returned handle completes when it landed); HOST and
        DEVICE copies are done on return. An existing key is replaced once the new bytes are in
        place; it must not be fetched (pinned) at the time.
        """
        dtype = dtype or tensor.dtype
        staged = self.stage(key, tuple(tensor.shape), dtype, tier)
        try:
            self._fill(staged.buffer, tensor, dtype)
        except BaseException as e:
            staged.abort(e)
            raise
        return staged.commit()

    def stage(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, tier: Tier = Tier.NVME) -> StagedPut:
        """A put whose bytes the caller writes in place: fill `.tensor`, then `commit()` (what
        `put` returns) or `abort(error)`. Until then the key is on its way, and fetches of it wait."""
        tier = Tier(tier)
        nbytes = math.prod(shape) * dtype.itemsize
        stage = Tier.HOST if tier == Tier.NVME else tier
        with self._cond:
            self._check_open()
            old = self._settled(key)
            rec = KeyRecord(key, nbytes, dtype, tuple(shape), MOVING[tier], dirty=True)
            rec.move = Move(Residency.NVME, tier)
            self._records[key] = rec
        try:
            buf = self._reserve(stage, nbytes, rec)
        except BaseException as e:
            self._undo_put(rec, old, e)
            raise
        return StagedPut(self, rec, old, tier, buf)

    def _commit_put(self, staged: StagedPut) -> Handle:
        rec, buf, old = staged.record, staged.buffer, staged.old
        tail = round_up(rec.nbytes) - rec.nbytes
        if tail:  # the same bytes on every write of the key, whatever the buffer held before
            buf.tensor[rec.nbytes : rec.nbytes + tail].zero_()
        if buf.tensor.is_cuda:
            torch.cuda.current_stream(buf.tensor.device).synchronize()  # filled on the caller's stream
        if staged.tier != Tier.NVME:
            with self._cond:
                move, rec.buffer = rec.move, buf
                self._land(rec, STABLE[staged.tier], old_buffer=self._old_memory(old))
                self._swap.discard(rec.key)  # the swap copy is stale now
                view = rec.view()
            move.future.set_result(view)
            return Handle.completed()
        return self._write(rec, buf, old)

    def fetch(self, key: str, tier: Tier = Tier.DEVICE) -> Future:
        """A future of the key's tensor in `tier` (HOST or DEVICE), pinned there until `release`."""
        tier = Tier(tier)
        if tier == Tier.NVME:
            raise ValueError("fetch() brings a key into memory: ask for Tier.HOST or Tier.DEVICE.")
        with self._cond:
            self._check_open()
            rec = self._record(key)
            target = rec.move.target if rec.move else rec.tier
            if rec.pins and target != tier:
                raise ValueError(f"key {key!r} is in use in {target.name} ({rec.pins} fetches not released); "
                                 f"release it before fetching it to {tier.name}.")
            rec.pins += 1
            rec.last_use = next(self._clock)
            self._counts["fetches"] += 1
            return self._bring(rec, tier, count=True)

    def prefetch(self, keys: Iterable[str], tier: Tier = Tier.DEVICE) -> None:
        """Start moving `keys` to `tier` in order, with at most `prefetch_bytes` in flight; returns at once."""
        tier = Tier(tier)
        if tier == Tier.NVME:
            raise ValueError("prefetch() brings keys into memory: ask for Tier.HOST or Tier.DEVICE.")
        with self._cond:
            self._check_open()
            for key in keys:
                self._record(key)
                self._prefetch.add(key, tier)
            self._pump_prefetch()

    def release(self, key: str, *, dirty: bool = False) -> None:
        """The caller is done with one fetch of `key`; `dirty=True` if it changed the tensor in place."""
        with self._cond:
            rec = self._record(key)
            if rec.pins == 0:
                raise ValueError(f"release({key!r}) without a matching fetch.")
            rec.pins -= 1
            rec.dirty |= dirty
            rec.last_use = next(self._clock)
            self._cond.notify_all()

    def delete(self, key: str) -> None:
        """Forget `key` and free its memory and swap space; it must not be pinned."""
        with self._cond:
            self._check_open()
            rec = self._settled(key, must_exist=True)
            if rec.buffer is not None:
                self._free(rec.tier, rec.buffer)
            del self._records[key]
            self._swap.discard(key)
            self._cond.notify_all()

    def evict(self, key: str, to: Tier = Tier.NVME) -> Handle:
        """Force `key` down to `to` (HOST or NVME), writing it back if dirty; it must not be pinned."""
        to = Tier(to)
        if to == Tier.DEVICE:
            raise ValueError("evict() moves a key down: use to=Tier.HOST or Tier.NVME.")
        with self._cond:
            self._check_open()
            rec = self._settled(key, must_exist=True)
            if rec.tier <= to:
                return Handle.completed()
            if to == Tier.HOST:
                return handle_of(self._start_move(rec, Tier.HOST, by_prefetch=False))
            staging = None
            if rec.dirty and not isinstance(rec.buffer, HostBuffer):  # CUDA: stage through HOST
                staging = self._reserve(Tier.HOST, rec.nbytes, rec)
                rec = self._settled(key, must_exist=True)  # the wait let others in
            return self._evict_record(rec, demote=False, staging=staging)

    def flush(self) -> None:
        """Wait until every write issued so far has landed, make them durable, write the index."""
        with self._cond:
            writes = list(self._writes)
        errors = []
        for h in writes:
            try:
                h.wait()
            except StorageError as e:
                errors.append(e)
        with self._cond:
            self._writes.difference_update(writes)
        self._swap.flush()
        if errors:
            raise errors[0]

    def stats(self) -> dict:
        """Bytes per tier, I/O totals and seconds, fetch and prefetch counts."""
        with self._cond:
            resident = Counter()
            for rec in self._records.values():
                if rec.tier is not None and rec.tier != Tier.NVME:
                    resident[rec.tier.name.lower()] += rec.nbytes
            out = {
                "device": {"budget": self._dev.budget, "in_use": self._dev.in_use, "cached": self._dev.cached,
                           "peak": self._dev.peak, "resident": resident["device"]},
                "host": {"budget": self._host.budget, "in_use": self._host.in_use, "cached": self._host.cached,
                         "peak": self._host.peak, "resident": resident["host"]},
                "nvme": {"bytes": self._swap.used, "file_bytes": self._swap.capacity, "direct": self._swap.direct},
                "keys": len(self._records),
            }
            counts = dict(self._counts)
        out.update(self._engine.counters.snapshot())
        for name in ("fetches", "hits", "misses", "prefetch_issued", "prefetch_hits", "prefetch_late",
                     "prefetch_dropped", "evictions", "writebacks"):
            out[name] = counts.get(name, 0)
        out["prefetch_misses"] = out["misses"]
        return out

    def ram_tier_of(self, key: str) -> Tier | None:
        """On a CPU-only store, the memory tier `key` rests in now; None on NVMe, while it moves, or
        with a GPU. HOST and DEVICE are the same RAM there, so a CPU computation may fetch the key
        where it is instead of moving it, which would only shift budget and evict other keys. A
        hint: the key may move before the fetch, which then brings it back, correctly."""
        with self._cond:
            rec = self._record(key)
            return rec.tier if self._zero_copy and rec.tier in (Tier.HOST, Tier.DEVICE) else None

    def __contains__(self, key: str) -> bool:
        with self._cond:
            return key in self._records

    def keys(self) -> list[str]:
        with self._cond:
            return list(self._records)

    def close(self, *, keep_files: bool = False) -> None:
        """Flush, stop the workers and (unless `keep_files`) delete the swap file: it is scratch."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            with self._cond:
                self._closed = True
                self._prefetch.clear()
            self._movers.shutdown(wait=True)
            self._write_queue.put(None)
            self._writer.join()
            self._engine.close()
            self._swap.close(remove=not keep_files)
            self._host.close()
            self._dev.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- moves (self._cond held unless said otherwise) ---------------------------------------------

    def _bring(self, rec: KeyRecord, tier: Tier, *, count: bool) -> Future:
        """The future of `rec` arriving in `tier`: resident, joining a move, or starting one."""
        if rec.state == STABLE[tier]:
            if count:
                self._counts["hits"] += 1
                if rec.prefetched:
                    self._counts["prefetch_hits"] += 1
            rec.prefetched = False
            return done_future(rec.view())
        move = rec.move
        if move is None:
            future = self._start_move(rec, tier, by_prefetch=False)
            if count:  # a zero-copy hand-over is done at once: nobody waited
                self._counts["hits" if future.done() else "misses"] += 1
            return future
        if count:
            self._counts["misses"] += 1
        if move.target == tier:
            if count and move.by_prefetch:
                self._counts["prefetch_late"] += 1
            return move.future
        # Moving elsewhere: go on from wherever it lands.
        out: Future = Future()

        def again(landed: Future) -> None:
            with self._cond:
                if self._records.get(rec.key) is not rec:  # a put failed and its record was dropped
                    out.set_exception(landed.exception() or StorageError(f"key {rec.key!r} was dropped"))
                    return
                nxt = self._bring(rec, tier, count=False)
            nxt.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception()
                                  else out.set_result(f.result()))

        move.future.add_done_callback(again)
        return out

    def _start_move(self, rec: KeyRecord, tier: Tier, *, by_prefetch: bool) -> Future:
        assert rec.move is None and rec.tier is not None and rec.tier != tier
        if self._zero_copy and rec.tier != Tier.NVME and self._hand_over(rec, tier):
            rec.prefetched = by_prefetch and rec.pins == 0
            return done_future(rec.view())
        move = rec.move = Move(rec.state, tier, by_prefetch=by_prefetch)
        rec.to(MOVING[tier])
        self._movers.submit(self._run_move, rec, move)
        return move.future

    def _hand_over(self, rec: KeyRecord, tier: Tier) -> bool:
        """CPU-only HOST <-> DEVICE: move the buffer's accounting, not its bytes."""
        src, dst = self._mem[rec.tier], self._mem[tier]
        if rec.buffer.capacity > dst.budget or not dst.try_adopt(rec.buffer):
            return False
        src.detach(rec.buffer)
        rec.to(STABLE[tier])
        self._cond.notify_all()
        return True

    def _run_move(self, rec: KeyRecord, move: Move) -> None:
        """Mover thread: bring `rec`'s bytes from `move.source` to `move.target` and land them."""
        try:
            buf = self._carry(rec, move)
        except BaseException as e:  # noqa: BLE001 - goes to every waiter through the future
            with self._cond:
                if rec.move is move:  # (a dropped prefetch was rolled back already)
                    rec.move = None
                    rec.to(move.source)
                self._cond.notify_all()
                if isinstance(e, _PrefetchDropped):
                    self._counts["prefetch_dropped"] += 1
            move.future.set_exception(e)
            return
        with self._cond:
            old = rec.buffer if move.source != Residency.NVME and buf is not rec.buffer else None
            rec.buffer = buf
            if move.source == Residency.NVME:
                rec.dirty = False
            self._land(rec, STABLE[move.target], old_buffer=(old, move.source) if old else None)
            rec.prefetched = move.by_prefetch and rec.pins == 0
            view = rec.view()
        move.future.set_result(view)

    def _carry(self, rec: KeyRecord, move: Move) -> Buffer:
        """Mover thread, lock not held: copy the bytes into a new buffer of the target tier."""
        src, target = move.source, move.target
        if self._zero_copy and src != Residency.NVME:  # RAM to RAM: wait for room, then hand over
            self._reserve(target, rec.nbytes, rec, move, attempt=lambda: rec.buffer if self._mem[target].try_adopt(
                rec.buffer) else None)
            with self._cond:
                self._mem[Tier.HOST if target == Tier.DEVICE else Tier.DEVICE].detach(rec.buffer)
            return rec.buffer
        if src == Residency.NVME and (target == Tier.HOST or self._zero_copy):
            buf = self._reserve(target, rec.nbytes, rec, move)
            self._read_into(rec, buf, target)
            return buf
        # CUDA: NVME -> DEVICE stages through HOST; HOST <-> DEVICE copies on the copy stream.
        dst = self._reserve(target, rec.nbytes, rec, move)
        try:
            if src == Residency.NVME:
                staging = self._reserve(Tier.HOST, rec.nbytes, rec, move)
                try:
                    self._read_into(rec, staging, None)
                    self._dev.to_device(staging, dst, rec.nbytes)
                finally:
                    self._free(Tier.HOST, staging)
            elif target == Tier.DEVICE:
                self._dev.to_device(rec.buffer, dst, rec.nbytes)
            else:
                self._dev.to_host(rec.buffer, dst, rec.nbytes)
        except BaseException:
            self._free(target, dst)
            raise
        return dst

    def _read_into(self, rec: KeyRecord, buf: HostBuffer, tier: Tier | None) -> None:
        try:
            self._swap.read(rec.key, buf.array).wait()
        except BaseException:
            self._free(tier or Tier.HOST, buf)
            raise

    def _land(self, rec: KeyRecord, state: Residency, old_buffer=None) -> None:
        """A move arrived: new state, free what the source held, wake whoever waits."""
        rec.to(state)
        rec.move = None
        if old_buffer is not None:
            buf, where = old_buffer
            self._free(TIER_OF[where], buf)
        self._cond.notify_all()

    def _write(self, rec: KeyRecord, staging: HostBuffer, old: KeyRecord | None) -> Handle:
        """Write a put's staged bytes; the handle completes once the new state has landed."""
        done = Handle()
        try:
            io = self._swap.write(rec.key, staging.array, rec.nbytes, rec.dtype, rec.shape)
        except BaseException as e:
            self._free(Tier.HOST, staging)
            self._undo_put(rec, old, e)
            raise

        def landed(h: Handle) -> None:
            error = h.exception()
            with self._cond:
                move = rec.move
                old_mem = self._old_memory(old)
                if error is None:
                    self._free(Tier.HOST, staging)
                    rec.dirty = False
                    self._land(rec, Residency.NVME, old_buffer=old_mem)
                else:  # keep the bytes: they stay in HOST, dirty, and nothing is lost
                    log.error("write of %r failed; it stays in host memory: %s", rec.key, error)
                    rec.buffer = staging
                    self._land(rec, Residency.HOST, old_buffer=old_mem)
            move.future.set_result(None)
            done.set_done(error)

        with self._cond:
            self._writes.add(done)
        io.add_done_callback(landed)
        return done

    def _evict_record(self, rec: KeyRecord, *, demote: bool, staging: HostBuffer | None = None) -> Handle | None:
        """Move a released, resident key out of memory; None if it cannot start without waiting.

        `demote`: DEVICE -> HOST when that costs nothing (CPU-only). A dirty CUDA buffer needs a
        HOST staging buffer: the caller's `staging`, or one free right now.
        [Note: no I/O under the lock] Write-backs are queued to the writer thread, never issued
        here: a thread holding the store lock must never wait for an I/O slot, because I/O
        completions take the lock to land.
        """
        tier = rec.tier
        assert rec.pins == 0 and rec.move is None and tier in (Tier.HOST, Tier.DEVICE)
        if demote and tier == Tier.DEVICE and self._zero_copy and self._hand_over(rec, Tier.HOST):
            self._counts["evictions"] += 1
            return Handle.completed()
        if not rec.dirty:
            self._counts["evictions"] += 1
            self._free(tier, rec.buffer)
            rec.buffer = None
            rec.to(Residency.NVME)
            self._cond.notify_all()
            return Handle.completed()
        if not isinstance(rec.buffer, HostBuffer) and staging is None:
            staging = self._host.try_acquire(rec.nbytes)
            if staging is None:
                return None
        self._counts["evictions"] += 1
        self._counts["writebacks"] += 1
        move = rec.move = Move(rec.state, Tier.NVME)
        rec.to(Residency.TO_NVME)
        self._freeing[tier] += rec.buffer.capacity
        self._write_queue.put((rec, move, tier, rec.buffer, staging))
        done = handle_of(move.future)
        self._writes.add(done)
        return done

    def _write_loop(self) -> None:
        """The writer thread: issues write-backs in order; see [Note: no I/O under the lock]."""
        lower_priority(self.io.nice)
        while (job := self._write_queue.get()) is not None:
            rec, move, tier, buf, staging = job
            if staging is not None:
                try:
                    self._dev.to_host(buf, staging, rec.nbytes)  # CUDA: down to pinned memory first
                except BaseException as e:  # noqa: BLE001
                    self._free(Tier.HOST, staging)
                    self._writeback_failed(rec, move, tier, e)
                    continue
            self._submit_writeback(rec, move, tier, buf, staging)

    def _submit_writeback(self, rec: KeyRecord, move: Move, tier: Tier, buf: Buffer,
                          staging: HostBuffer | None) -> None:
        source = staging or buf
        try:
            io = self._swap.write(rec.key, source.array, rec.nbytes, rec.dtype, rec.shape)
        except BaseException as e:  # noqa: BLE001
            if staging is not None:
                self._free(Tier.HOST, staging)
            self._writeback_failed(rec, move, tier, e)
            return

        def landed(h: Handle) -> None:
            if staging is not None:
                self._free(Tier.HOST, staging)
            if h.exception() is not None:
                self._writeback_failed(rec, move, tier, h.exception())
                return
            with self._cond:
                self._freeing[tier] -= buf.capacity
                rec.buffer = None
                rec.dirty = False
                self._land(rec, Residency.NVME, old_buffer=(buf, STABLE[tier]))
            move.future.set_result(None)

        io.add_done_callback(landed)

    def _writeback_failed(self, rec: KeyRecord, move: Move, tier: Tier, error: BaseException) -> None:
        with self._cond:
            self._freeing[tier] -= rec.buffer.capacity
            rec.move = None
            rec.to(move.source)  # the bytes stay in memory, still dirty: nothing is lost
            self._last_writeback_error = error
            self._cond.notify_all()
        log.error("write-back of %r failed; it stays in memory: %s", rec.key, error)
        move.future.set_exception(error)

    # -- budgets ----------------------------------------------------------------------------------

    def _reserve(self, tier: Tier, nbytes: int, rec: KeyRecord, move: Move | None = None, attempt=None) -> Buffer:
        """Room for `nbytes` in `tier`: evict released keys, then wait (bounded) for room to appear.

        A prefetch nobody waits for waits only for room already on its way out (write-backs in
        flight), and never while a request someone does wait for is waiting for room in the same
        tier: it would take that room first. Otherwise it gives up at once; see _PrefetchDropped.
        """
        mem = self._mem[tier]
        attempt = attempt or (lambda: mem.try_acquire(nbytes))
        deadline = time.monotonic() + self.wait_timeout
        waiting = False  # counted in _demand_waiting
        with self._cond:
            errors_before = self._last_writeback_error
            try:
                while True:
                    unwanted = move is not None and move.by_prefetch and rec.pins == 0 and rec.move is move
                    if unwanted and self._demand_waiting[tier]:
                        self._drop_prefetch(rec, move, tier)
                    buf = attempt()
                    if buf is not None:
                        return buf
                    if self._evict_for(tier, nbytes, exclude=rec, for_prefetch=unwanted):
                        continue
                    if unwanted and not self._room_on_its_way(tier, nbytes):
                        self._drop_prefetch(rec, move, tier)
                    error = self._last_writeback_error
                    if error is not None and error is not errors_before:
                        raise error
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._out_of_budget(tier, nbytes, rec)
                    if not unwanted and not waiting:
                        self._demand_waiting[tier] += 1
                        waiting = True
                    self._cond.wait(min(left, 0.05))
            finally:
                if waiting:
                    self._demand_waiting[tier] -= 1

    def _out_of_budget(self, tier: Tier, nbytes: int, rec: KeyRecord) -> OutOfBudgetError:
        pinned = sum(r.nbytes for r in self._records.values() if r.pins and r.tier == tier)
        return OutOfBudgetError(tier.name, nbytes, self._mem[tier].budget,
                                f"Waited {self.wait_timeout:.0f} s for {rec.key!r}; "
                                f"{pinned:,} bytes stay pinned in {tier.name}.")

    def _drop_prefetch(self, rec: KeyRecord, move: Move, tier: Tier) -> NoReturn:
        """Give a prefetch up: the key goes back to where it was, and the mover thread is told why."""
        rec.move = None
        rec.to(move.source)
        self._cond.notify_all()
        raise _PrefetchDropped(f"no room in {tier.name} to prefetch {rec.key!r}")

    def _room_on_its_way(self, tier: Tier, nbytes: int) -> bool:
        """Free room plus write-backs in flight in `tier` cover `nbytes`: waiting will find it."""
        return self._mem[tier].available() + self._freeing[tier] >= round_up(max(nbytes, 1))

    def _evict_for(self, tier: Tier, nbytes: int, exclude: KeyRecord, *, for_prefetch: bool = False) -> bool:
        """Start evicting the least recently used released key of `tier`; False if none can help.

        Keys prefetched and not yet used go last, and never to make room for another prefetch:
        prefetches are issued in the order they will be used, so the older one is wanted sooner
        (evicting it read every optimizer chunk twice, once ahead and once on demand).
        """
        if self._room_on_its_way(tier, nbytes):
            return False  # enough is already on its way out
        state = STABLE[tier]
        victims = [r for r in self._records.values() if r.state == state and r.pins == 0 and r.move is None
                   and r is not exclude and not (for_prefetch and r.prefetched)]
        for victim in sorted(victims, key=lambda r: (r.prefetched, r.last_use)):
            if self._evict_record(victim, demote=True) is not None:
                return True
        return False

    def _free(self, tier: Tier, buf: Buffer) -> None:
        with self._cond:
            self._mem[tier].release(buf)
            self._cond.notify_all()

    # -- prefetch ---------------------------------------------------------------------------------

    def _pump_prefetch(self) -> None:
        if not self._closed:
            self._prefetch.pump(self._records, self._start_prefetch, self._prefetch_landed)

    def _start_prefetch(self, rec: KeyRecord, tier: Tier) -> Future:
        self._counts["prefetch_issued"] += 1
        return self._start_move(rec, tier, by_prefetch=True)

    def _prefetch_landed(self, nbytes: int) -> None:
        with self._cond:
            self._prefetch.inflight -= nbytes
            self._pump_prefetch()

    # -- helpers ----------------------------------------------------------------------------------

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

    def _old_memory(self, old: KeyRecord | None):
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
        move.future.set_exception(error)  # fetches that chained on the failed put see why

    def _fill(self, buf: Buffer, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        """Copy a caller's tensor in (any device), as `dtype`; lock not held."""
        if isinstance(buf, HostBuffer):
            buf.fill_from(tensor, dtype)  # from CUDA this is a synchronous device-to-host copy
        else:
            self._dev.fill(buf, tensor, dtype)

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("the store is closed.")
