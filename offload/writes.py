"""Writes to NVMe, part of `TieredStore` (see store_core.py): puts landing on NVMe, and write-backs
of dirty keys leaving memory, queued to the writer thread (write_back.py)."""

from __future__ import annotations

import logging

from outcore.offload.buffers import HostBuffer
from outcore.offload.handle import Handle, handle_of
from outcore.offload.residency import STABLE, KeyRecord, Move, Residency, Tier
from outcore.offload.store_core import StoreCore
from outcore.offload.write_back import WriteBackJob

log = logging.getLogger("outcore.offload.store")


class Writes(StoreCore):
    """Writes to NVMe: puts, and write-backs of dirty keys leaving memory (self._cond held unless said)."""

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
                self._freeing[Tier.HOST] -= staging.capacity
                move = rec.move
                assert move is not None
                old_mem = self._old_memory(old)
                if error is None:
                    self._free(Tier.HOST, staging)
                    rec.dirty = False
                    self._land(rec, Residency.NVME, old_buffer=old_mem)
                else:  # keep the bytes: they stay in HOST, dirty, and nothing is lost
                    self._write_failed(rec.key, error)
                    rec.buffer = staging
                    self._land(rec, Residency.HOST, old_buffer=old_mem)
            move.future.set_result(None)
            done.set_done(error)

        with self._cond:
            self._track_write(done)
            # The staging buffer is free once the write lands: room on its way, which a request
            # waits for rather than evicting a key (budgets.py).
            self._freeing[Tier.HOST] += staging.capacity
        io.add_done_callback(landed)
        return done

    def _evict_record(self, rec: KeyRecord, *, demote: bool, staging: HostBuffer | None = None) -> Handle | None:
        """Move a released, resident key out of memory; None if it cannot start without waiting.

        `demote`: DEVICE -> HOST when that costs nothing (CPU-only). A dirty CUDA buffer needs a
        HOST staging buffer: the caller's `staging`, or one free right now.
        The write itself is queued to the writer thread: see [Note: no I/O under the lock].
        """
        tier = rec.stable_tier
        assert rec.pins == 0 and rec.move is None and tier in (Tier.HOST, Tier.DEVICE)
        if demote and tier == Tier.DEVICE and self._zero_copy and self._hand_over(rec, Tier.HOST):
            self._counts["evictions"] += 1
            return Handle.completed()
        if not rec.dirty:
            self._counts["evictions"] += 1
            self._free(tier, rec.held)
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
        self._freeing[tier] += rec.held.capacity
        self._writer.submit(WriteBackJob(rec, move, tier, rec.held, staging))
        done = handle_of(move.future)
        self._track_write(done)
        return done

    def _run_write_back(self, job: WriteBackJob) -> None:
        """The writer thread: copy a CUDA buffer down to its staging buffer, then issue the write."""
        if job.staging is not None:
            try:
                self._cuda.to_host(job.buffer, job.staging, job.record.nbytes)
            except BaseException as e:  # noqa: BLE001
                self._free(Tier.HOST, job.staging)
                self._writeback_failed(job, e)
                return
        rec = job.record
        try:
            io = self._swap.write(rec.key, job.source.array, rec.nbytes, rec.dtype, rec.shape)
        except BaseException as e:  # noqa: BLE001
            if job.staging is not None:
                self._free(Tier.HOST, job.staging)
            self._writeback_failed(job, e)
            return

        def landed(h: Handle) -> None:
            if job.staging is not None:
                self._free(Tier.HOST, job.staging)
            error = h.exception()
            if error is not None:
                self._writeback_failed(job, error)
                return
            with self._cond:
                self._freeing[job.tier] -= job.buffer.capacity
                rec.buffer = None
                rec.dirty = False
                self._land(rec, Residency.NVME, old_buffer=(job.buffer, STABLE[job.tier]))
            job.move.future.set_result(None)

        io.add_done_callback(landed)

    def _write_failed(self, key: str, error: BaseException) -> None:
        """Said once per store: a full disk fails every write that follows, and each is counted."""
        with self._cond:
            self._counts["writes_failed"] += 1
            first = self._counts["writes_failed"] == 1
        if first:
            log.error("writing %r to NVMe failed; it stays in memory, nothing is lost (later failures are counted "
                      "in stats()['writes_failed']): %s", key, error)

    def _writeback_failed(self, job: WriteBackJob, error: BaseException) -> None:
        rec, move = job.record, job.move
        with self._cond:
            self._freeing[job.tier] -= job.buffer.capacity
            rec.move = None
            rec.to(move.source)  # the bytes stay in memory, still dirty: nothing is lost
            self._last_writeback_error = error
            self._cond.notify_all()
        self._write_failed(rec.key, error)
        move.future.set_exception(error)
