"""The tiered store's movers: bring a key into a memory tier, joining a move already on its way.

Part of `TieredStore` (see store_core.py). A move runs on a mover thread: it reserves room in the
target tier (budgets.py), reads the swap file or copies between tiers, and lands the new state.
On a CPU-only machine HOST and DEVICE are the same RAM, and a move between them hands the buffer
from one budget to the other without copying a byte.
"""

from __future__ import annotations

from concurrent.futures import Future

from outcore.offload.buffers import Buffer, HostBuffer
from outcore.offload.errors import StorageError
from outcore.offload.handle import done_future
from outcore.offload.residency import MOVING, STABLE, KeyRecord, Move, Residency, Tier
from outcore.offload.store_core import PrefetchDropped, StoreCore


class Moves(StoreCore):
    """Moves into memory (self._cond held unless said otherwise)."""

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
        src, dst = self._ram(rec.stable_tier), self._ram(tier)
        if rec.held.capacity > dst.budget or not dst.try_adopt(rec.held):
            return False
        src.detach(rec.held)
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
                if isinstance(e, PrefetchDropped):
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
            held = rec.held
            self._reserve(target, rec.nbytes, rec, move,
                          attempt=lambda: held if self._ram(target).try_adopt(held) else None)
            with self._cond:
                self._ram(Tier.HOST if target == Tier.DEVICE else Tier.DEVICE).detach(held)
            return held
        if src == Residency.NVME and (target == Tier.HOST or self._zero_copy):
            buf = self._reserve(target, rec.nbytes, rec, move)
            assert isinstance(buf, HostBuffer)
            self._read_into(rec, buf, target)
            return buf
        # CUDA: NVME -> DEVICE stages through HOST; HOST <-> DEVICE copies on the copy stream.
        dst = self._reserve(target, rec.nbytes, rec, move)
        try:
            if src == Residency.NVME:
                staging = self._reserve(Tier.HOST, rec.nbytes, rec, move)
                assert isinstance(staging, HostBuffer)
                try:
                    self._read_into(rec, staging, None)
                    self._cuda.to_device(staging, dst, rec.nbytes)
                finally:
                    self._free(Tier.HOST, staging)
            elif target == Tier.DEVICE:
                source = rec.held
                assert isinstance(source, HostBuffer)
                self._cuda.to_device(source, dst, rec.nbytes)
            else:
                assert isinstance(dst, HostBuffer)
                self._cuda.to_host(rec.held, dst, rec.nbytes)
        except BaseException:
            self._free(target, dst)
            raise
        return dst

    def _read_into(self, rec: KeyRecord, buf: HostBuffer, tier: Tier | None) -> None:
        try:
            if rec.source is not None:  # offload/file_source.py [Note: read in place]
                rec.source.read_into(buf.view(rec.nbytes, rec.dtype, (rec.source.numel,)), self._engine)
                return
            self._swap.read(rec.key, buf.array).wait()
        except BaseException:
            self._free(tier or Tier.HOST, buf)
            raise

