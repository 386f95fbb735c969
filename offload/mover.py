"""The store's movers: bring a key into a memory tier, joining a move already on its way.

A move runs on a mover thread: it reserves room in the target tier (room.py), reads the swap file
or copies between tiers, and lands the new state. On a CPU-only machine HOST and DEVICE are the
same RAM, and a move between them hands the buffer from one budget to the other without copying a
byte.
"""

from __future__ import annotations

import torch

from outcore.offload.background import background_pool
from outcore.offload.buffers import Buffer, HostBuffer
from outcore.offload.errors import StorageError
from outcore.offload.handle import Handle
from outcore.offload.residency import MOVING, STABLE, KeyRecord, Move, Residency, Tier
from outcore.offload.room import Room
from outcore.offload.store_state import PrefetchDropped, StoreState


class Mover:
    """Moves into memory (the store's lock held unless said otherwise)."""

    def __init__(self, state: StoreState, room: Room) -> None:
        self.state, self.room = state, room
        self.pool = background_pool(max(4, state.io.threads), "outcore-move", state.io.nice)

    def close(self) -> None:
        """Finish the moves under way, then stop the mover threads."""
        self.pool.shutdown(wait=True)

    def bring(self, rec: KeyRecord, tier: Tier, *, count: bool) -> Handle[torch.Tensor]:
        """The handle of `rec` arriving in `tier`: resident, joining a move, or starting one."""
        counts = self.state.counts
        if rec.state == STABLE[tier]:
            if count:
                counts["hits"] += 1
                if rec.prefetched:
                    counts["prefetch_hits"] += 1
            rec.prefetched = False
            return Handle.completed(rec.view())
        move = rec.move
        if move is None:
            handle = self.start(rec, tier, by_prefetch=False)
            if count:  # a zero-copy hand-over is done at once: nobody waited
                counts["hits" if handle.done() else "misses"] += 1
            return handle
        if count:
            counts["misses"] += 1
        if move.target == tier:
            if count and move.by_prefetch:
                counts["prefetch_late"] += 1
            return move.handle
        # Moving elsewhere: go on from wherever it lands.
        out: Handle[torch.Tensor] = Handle()

        def again(landed: Handle[torch.Tensor]) -> None:
            with self.state.cond:
                if self.state.records.get(rec.key) is not rec:  # a put failed and its record was dropped
                    out.set_exception(landed.exception() or StorageError(f"key {rec.key!r} was dropped"))
                    return
                nxt = self.bring(rec, tier, count=False)
            out.follow(nxt)

        move.handle.add_done_callback(again)
        return out

    def start(self, rec: KeyRecord, tier: Tier, *, by_prefetch: bool) -> Handle[torch.Tensor]:
        """Start moving a settled key to `tier`."""
        assert rec.move is None and rec.tier is not None and rec.tier != tier
        if self.state.zero_copy and rec.tier != Tier.NVME and self.state.hand_over(rec, tier):
            rec.prefetched = by_prefetch and rec.pins == 0
            return Handle.completed(rec.view())
        move = rec.move = Move(rec.state, tier, by_prefetch=by_prefetch)
        rec.to(MOVING[tier])
        self.pool.submit(self._run, rec, move)
        return move.handle

    def _run(self, rec: KeyRecord, move: Move) -> None:
        """Mover thread: bring `rec`'s bytes from `move.source` to `move.target` and land them."""
        state = self.state
        try:
            buf = self._carry(rec, move)
        except BaseException as e:  # noqa: BLE001 - goes to every waiter through the handle
            with state.cond:
                if rec.move is move:  # (a dropped prefetch was rolled back already)
                    rec.move = None
                    rec.to(move.source)
                state.cond.notify_all()
                if isinstance(e, PrefetchDropped):
                    state.counts["prefetch_dropped"] += 1
            move.handle.set_exception(e)
            return
        with state.cond:
            old = rec.buffer if move.source != Residency.NVME and buf is not rec.buffer else None
            rec.buffer = buf
            if move.source == Residency.NVME:
                rec.dirty = False
            state.land(rec, STABLE[move.target], old_buffer=(old, move.source) if old else None)
            rec.prefetched = move.by_prefetch and rec.pins == 0
            view = rec.view()
        move.handle.set_result(view)

    def _carry(self, rec: KeyRecord, move: Move) -> Buffer:
        """Mover thread, lock not held: copy the bytes into a new buffer of the target tier."""
        state, reserve = self.state, self.room.reserve
        src, target = move.source, move.target
        if state.zero_copy and src != Residency.NVME:  # RAM to RAM: wait for room, then hand over
            held = rec.held
            reserve(target, rec.nbytes, rec, move, attempt=lambda: held if state.ram(target).try_adopt(held) else None)
            with state.cond:
                state.ram(Tier.HOST if target == Tier.DEVICE else Tier.DEVICE).detach(held)
            return held
        if src == Residency.NVME and (target == Tier.HOST or state.zero_copy):
            buf = reserve(target, rec.nbytes, rec, move)
            assert isinstance(buf, HostBuffer)
            self._read_into(rec, buf, target)
            return buf
        # CUDA: NVME -> DEVICE stages through HOST; HOST <-> DEVICE copies on the copy stream.
        dst = reserve(target, rec.nbytes, rec, move)
        try:
            if src == Residency.NVME:
                staging = reserve(Tier.HOST, rec.nbytes, rec, move)
                assert isinstance(staging, HostBuffer)
                try:
                    self._read_into(rec, staging, None)
                    state.cuda.to_device(staging, dst, rec.nbytes)
                finally:
                    state.free(Tier.HOST, staging)
            elif target == Tier.DEVICE:
                source = rec.held
                assert isinstance(source, HostBuffer)
                state.cuda.to_device(source, dst, rec.nbytes)
            else:
                assert isinstance(dst, HostBuffer)
                state.cuda.to_host(rec.held, dst, rec.nbytes)
        except BaseException:
            state.free(target, dst)
            raise
        return dst

    def _read_into(self, rec: KeyRecord, buf: HostBuffer, tier: Tier | None) -> None:
        state = self.state
        try:
            if rec.source is not None:  # offload/file_source.py [Note: read in place]
                rec.source.read_into(buf.view(rec.nbytes, rec.dtype, (rec.source.numel,)), state.engine)
                return
            state.swap.read(rec.key, buf.array).wait()
        except BaseException:
            state.free(tier or Tier.HOST, buf)
            raise
