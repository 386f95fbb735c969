"""Writes to NVMe: puts landing there, and write-backs of dirty keys leaving memory, queued to the
writer thread (write_back.py) and landed by their I/O's completion."""

from __future__ import annotations

import logging

from outcore.offload.buffers import HostBuffer
from outcore.offload.handle import Handle
from outcore.offload.residency import STABLE, KeyRecord, Move, Residency, Tier
from outcore.offload.store_state import StoreState
from outcore.offload.write_back import WriteBackJob, WriteBackWorker

log = logging.getLogger("outcore.offload.store")


class Writer:
    """The store's writes to NVMe (its lock held unless said otherwise)."""

    def __init__(self, state: StoreState) -> None:
        self.state = state
        self.worker = WriteBackWorker(self._run_write_back, state.io.nice)

    def close(self) -> None:
        """Issue what was queued, then stop the writer thread."""
        self.worker.close()

    def write(self, rec: KeyRecord, staging: HostBuffer, old: KeyRecord | None) -> Handle[None]:
        """Write a put's staged bytes; the handle completes once the new state has landed."""
        state = self.state
        done: Handle[None] = Handle()
        try:
            io = state.swap.write(rec.key, staging.array, rec.nbytes, rec.dtype, rec.shape)
        except BaseException as e:
            state.free(Tier.HOST, staging)
            state.undo_put(rec, old, e)
            raise

        def landed(h: Handle[None]) -> None:
            error = h.exception()
            with state.cond:
                state.freeing[Tier.HOST] -= staging.capacity
                move = rec.move
                assert move is not None
                old_mem = state.old_memory(old)
                if error is None:
                    state.free(Tier.HOST, staging)
                    rec.dirty = False
                    state.land(rec, Residency.NVME, old_buffer=old_mem)
                else:  # keep the bytes: they stay in HOST, dirty, and nothing is lost
                    self._write_failed(rec.key, error)
                    rec.buffer = staging
                    state.land(rec, Residency.HOST, old_buffer=old_mem)
            move.handle.set_result(None)
            done.set_done(error)

        with state.cond:
            state.track_write(done)
            # The staging buffer is free once the write lands: room on its way, which a request
            # waits for rather than evicting a key (room.py).
            state.freeing[Tier.HOST] += staging.capacity
        io.add_done_callback(landed)
        return done

    def evict_record(self, rec: KeyRecord, *, demote: bool,
                     staging: HostBuffer | None = None) -> Handle[None] | None:
        """Move a released, resident key out of memory; None if it cannot start without waiting.

        `demote`: DEVICE -> HOST when that costs nothing (CPU-only). A dirty CUDA buffer needs a
        HOST staging buffer: the caller's `staging`, or one free right now.
        The write itself is queued to the writer thread: see [Note: no I/O under the lock].
        """
        state = self.state
        tier = rec.stable_tier
        assert rec.pins == 0 and rec.move is None and tier in (Tier.HOST, Tier.DEVICE)
        if demote and tier == Tier.DEVICE and state.zero_copy and state.hand_over(rec, Tier.HOST):
            state.counts["evictions"] += 1
            return Handle.completed()
        if not rec.dirty:
            state.counts["evictions"] += 1
            state.free(tier, rec.held)
            rec.buffer = None
            rec.to(Residency.NVME)
            state.cond.notify_all()
            return Handle.completed()
        if not isinstance(rec.buffer, HostBuffer) and staging is None:
            staging = state.host.try_acquire(rec.nbytes)
            if staging is None:
                return None
        state.counts["evictions"] += 1
        state.counts["writebacks"] += 1
        move = rec.move = Move(rec.state, Tier.NVME)
        rec.to(Residency.TO_NVME)
        state.freeing[tier] += rec.held.capacity
        self.worker.submit(WriteBackJob(rec, move, tier, rec.held, staging))
        done: Handle[None] = Handle()
        done.follow(move.handle)
        state.track_write(done)
        return done

    def _run_write_back(self, job: WriteBackJob) -> None:
        """The writer thread: copy a CUDA buffer down to its staging buffer, then issue the write."""
        state = self.state
        if job.staging is not None:
            try:
                state.cuda.to_host(job.buffer, job.staging, job.record.nbytes)
            except BaseException as e:  # noqa: BLE001
                state.free(Tier.HOST, job.staging)
                self._writeback_failed(job, e)
                return
        rec = job.record
        try:
            io = state.swap.write(rec.key, job.source.array, rec.nbytes, rec.dtype, rec.shape)
        except BaseException as e:  # noqa: BLE001
            if job.staging is not None:
                state.free(Tier.HOST, job.staging)
            self._writeback_failed(job, e)
            return

        def landed(h: Handle[None]) -> None:
            if job.staging is not None:
                state.free(Tier.HOST, job.staging)
            error = h.exception()
            if error is not None:
                self._writeback_failed(job, error)
                return
            with state.cond:
                state.freeing[job.tier] -= job.buffer.capacity
                rec.buffer = None
                rec.dirty = False
                state.land(rec, Residency.NVME, old_buffer=(job.buffer, STABLE[job.tier]))
            job.move.handle.set_result(None)

        io.add_done_callback(landed)

    def _write_failed(self, key: str, error: BaseException) -> None:
        """Said once per store: a full disk fails every write that follows, and each is counted."""
        state = self.state
        with state.cond:
            state.counts["writes_failed"] += 1
            first = state.counts["writes_failed"] == 1
        if first:
            log.error("writing %r to NVMe failed; it stays in memory, nothing is lost (later failures are counted "
                      "in stats()['writes_failed']): %s", key, error)

    def _writeback_failed(self, job: WriteBackJob, error: BaseException) -> None:
        rec, move, state = job.record, job.move, self.state
        with state.cond:
            state.freeing[job.tier] -= job.buffer.capacity
            rec.move = None
            rec.to(move.source)  # the bytes stay in memory, still dirty: nothing is lost
            state.last_writeback_error = error
            state.cond.notify_all()
        self._write_failed(rec.key, error)
        move.handle.set_exception(error)
