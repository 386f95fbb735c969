"""The tiered store: keys paged between DEVICE memory, HOST buffers and an NVMe swap file.

Its API is in the README. One `KeyRecord` per key (see [Note: residency] in residency.py); every
state change happens under the store's lock, every byte moves outside it. The store is composed
of parts, each an object of its own over the shared state (store_state.py: records, lock, tiers):

- the mover (mover.py) runs moves that need memory and I/O on a small pool of threads; the move's
  handle is stored in the record, so a second fetch of a moving key joins it instead of moving it
  twice;
- the writer (writer.py) issues puts and write-backs, whose I/O completion lands the new state
  (write_back.py);
- the room (room.py) keeps each budget: a move that needs room has the writer evict released keys
  (eviction.py) and waits, bounded, for them to land;
- the kept versions (kept_versions.py) hold earlier bytes of keys an owner may take back.
Every asynchronous call returns a `Handle` (handle.py). This file is the API.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from outcore.offload.buffers import Buffer, HostBuffer
from outcore.offload.errors import StorageError
from outcore.offload.exit_close import close_at_exit, forget
from outcore.offload.file_source import FileSource
from outcore.offload.handle import Handle
from outcore.offload.io_config import IOConfig, round_up
from outcore.offload.kept_versions import KeptVersions
from outcore.offload.mover import Mover
from outcore.offload.residency import MOVING, STABLE, KeyRecord, Move, Residency, Tier
from outcore.offload.room import Room
from outcore.offload.store_state import StoreState
from outcore.offload.writer import Writer


class StagedPut:
    """A put in progress (`TieredStore.stage`): write `tensor`, then `commit()` once or `abort(error)`."""

    def __init__(self, store: TieredStore, record: KeyRecord, old: KeyRecord | None, tier: Tier,
                 buffer: Buffer) -> None:
        self.store, self.record, self.old, self.tier, self.buffer = store, record, old, tier, buffer
        self.tensor = buffer.view(record.nbytes, record.dtype, record.shape)
        self._open = True

    def commit(self) -> Handle[None]:
        assert self._open, "StagedPut committed or aborted twice"
        self._open = False
        return self.store._commit_put(self)

    def abort(self, error: BaseException) -> None:
        if self._open:
            self._open = False
            self.store.state.free(Tier.HOST if self.tier == Tier.NVME else self.tier, self.buffer)
            self.store.state.undo_put(self.record, self.old, error)



class TieredStore:
    """Tensors by key, resting on NVMe, HOST or DEVICE, moved asynchronously between them."""

    def __init__(self, nvme_dir: str, device: str | torch.device = "cpu", device_budget: int = 1 << 30,
                 host_budget: int = 1 << 30, io: IOConfig | None = None, *, rank: int = 0,
                 nvme_preallocate: int = 0, prefetch_bytes: int | None = None,
                 wait_timeout: float = 30.0) -> None:
        self.state = StoreState(nvme_dir, device, device_budget, host_budget, io, rank=rank,
                                nvme_preallocate=nvme_preallocate, prefetch_bytes=prefetch_bytes,
                                wait_timeout=wait_timeout)
        self.device, self.io = self.state.device, self.state.io
        self._writer = Writer(self.state)
        self._room = Room(self.state, self._writer)  # the writer's evictions make room
        self._mover = Mover(self.state, self._room)
        self._versions = KeptVersions(self.state)  # offload/kept_versions.py [Note: kept versions]
        self._exit_token = close_at_exit(self)  # a script that never closes it: offload/exit_close.py

    # -- public API -------------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor, tier: Tier = Tier.NVME, *,
            dtype: torch.dtype | None = None, return_home: bool = False) -> Handle[None]:
        """Store a copy of `tensor` under `key` in `tier`; the copy is taken before put returns.
        With `dtype`, the copy is converted to it on the way in (no intermediate tensor).

        To NVME the write is asynchronous (the returned handle completes when it landed); HOST and
        DEVICE copies are done on return. An existing key is replaced once the new bytes are in
        place; it must not be fetched (pinned) at the time.

        `return_home`: a hint that the key rests in `tier` and visits memory only to be changed
        (optimizer states streamed through HOST): after each dirty release the store sends it back
        at once, instead of when it next needs the room.
        """
        if tensor.is_meta:
            raise ValueError(f"put({key!r}): a tensor on the meta device has no bytes to store; materialize it "
                             "first, or stage() the key and fill it in place.")
        dtype = dtype or tensor.dtype
        staged = self.stage(key, tuple(tensor.shape), dtype, tier, return_home=return_home)
        try:
            self._fill(staged.buffer, tensor, dtype)
        except BaseException as e:
            staged.abort(e)
            raise
        return staged.commit()

    def stage(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, tier: Tier = Tier.NVME, *,
              return_home: bool = False) -> StagedPut:
        """A put whose bytes the caller writes in place: fill `.tensor`, then `commit()` (what
        `put` returns) or `abort(error)`. Until then the key is on its way, and fetches of it wait."""
        tier = Tier(tier)
        nbytes = math.prod(shape) * dtype.itemsize
        stage = Tier.HOST if tier == Tier.NVME else tier
        with self.state.cond:
            self.state.check_open()
            old = self.state.settled(key)
            self._versions.forget(key)  # a new value: nothing earlier is wanted back
            rec = KeyRecord(key, nbytes, dtype, tuple(shape), MOVING[tier], dirty=True, home=tier,
                            return_home=return_home)
            rec.move = Move(Residency.NVME, tier)
            self.state.records[key] = rec
        try:
            buf = self._room.reserve(stage, nbytes, rec)
        except BaseException as e:
            self.state.undo_put(rec, old, e)
            raise
        return StagedPut(self, rec, old, tier, buf)

    def put_source(self, key: str, source: FileSource, dtype: torch.dtype) -> None:
        """Store `key` as `source.numel` elements of `dtype` read from files the store does not own
        (offload/file_source.py [Note: read in place]): resting on NVMe without a byte written, read
        and converted to `dtype` by each fetch that brings it into memory, and never changed (a
        dirty release of it is an error). An existing key is replaced; it must not be pinned."""
        rec = KeyRecord(key, source.numel * dtype.itemsize, dtype, (source.numel,), Residency.NVME, source=source)
        with self.state.cond:
            self.state.check_open()
            old = self.state.settled(key)
            if old is not None:
                self._forget(old)
            self.state.records[key] = rec
            self.state.cond.notify_all()

    def _commit_put(self, staged: StagedPut) -> Handle[None]:
        rec, buf, old = staged.record, staged.buffer, staged.old
        tail = round_up(rec.nbytes) - rec.nbytes
        if tail:  # the same bytes on every write of the key, whatever the buffer held before
            buf.tensor[rec.nbytes : rec.nbytes + tail].zero_()
        if buf.tensor.is_cuda:
            torch.cuda.current_stream(buf.tensor.device).synchronize()  # filled on the caller's stream
        if staged.tier != Tier.NVME:
            with self.state.cond:
                move, rec.buffer = rec.move, buf
                assert move is not None
                self.state.land(rec, STABLE[staged.tier], old_buffer=self.state.old_memory(old))
                self.state.swap.discard(rec.key)  # the swap copy is stale now
                view = rec.view()
            move.handle.set_result(view)
            return Handle.completed()
        assert isinstance(buf, HostBuffer)  # a put to NVME is staged in HOST
        return self._writer.write(rec, buf, old)

    def fetch(self, key: str, tier: Tier = Tier.DEVICE) -> Handle[torch.Tensor]:
        """A handle of the key's tensor in `tier` (HOST or DEVICE), pinned there until `release`."""
        tier = Tier(tier)
        if tier == Tier.NVME:
            raise ValueError("fetch() brings a key into memory: ask for Tier.HOST or Tier.DEVICE.")
        with self.state.cond:
            self.state.check_open()
            rec = self.state.record(key)
            target = rec.move.target if rec.move else rec.stable_tier
            if rec.pins and target != tier:
                raise ValueError(f"key {key!r} is in use in {target.name} ({rec.pins} fetches not released); "
                                 f"release it before fetching it to {tier.name}.")
            rec.pins += 1
            rec.last_use = next(self.state.clock)
            self.state.counts["fetches"] += 1
            return self._mover.bring(rec, tier, count=True)

    def fetch_now(self, key: str, tier: Tier = Tier.DEVICE) -> torch.Tensor:
        """`fetch(key, tier).result()`, except that a fetch that fails holds no pin: after its error
        there is nothing to release, and a later fetch meets the same error, not a busy key."""
        handle = self.fetch(key, tier)
        try:
            return handle.result()
        except BaseException:
            with self.state.cond:
                rec = self.state.records.get(key)
                if rec is not None and rec.pins:
                    rec.pins -= 1
                    self.state.cond.notify_all()
            raise

    def prefetch(self, keys: Iterable[str], tier: Tier = Tier.DEVICE) -> None:
        """Start moving `keys` to `tier` in order, with at most `prefetch_bytes` in flight; returns at once."""
        tier = Tier(tier)
        if tier == Tier.NVME:
            raise ValueError("prefetch() brings keys into memory: ask for Tier.HOST or Tier.DEVICE.")
        with self.state.cond:
            self.state.check_open()
            for key in keys:
                self.state.record(key)
                self.state.prefetch.add(key, tier)
            self._pump_prefetch()

    def release(self, key: str, *, dirty: bool = False) -> None:
        """The caller is done with one fetch of `key`; `dirty=True` if it changed the tensor in place.
        A key put with `return_home=True` starts back to the tier it was put in when a dirty release
        leaves it unpinned."""
        with self.state.cond:
            rec = self.state.record(key)
            if rec.pins == 0:
                raise ValueError(f"release({key!r}) without a matching fetch.")
            if dirty and rec.source is not None:
                raise ValueError(f"release({key!r}, dirty=True): the key is read from files outcore does not own "
                                 "(put_source) and is never changed; put() a new value instead.")
            rec.pins -= 1
            rec.dirty |= dirty
            rec.last_use = next(self.state.clock)
            self.state.cond.notify_all()
            # Only the release that changed it: a key read where it rests (a parameter shard in
            # forward) stays, however dirty it is.
            going_home = (rec.return_home and dirty and rec.pins == 0 and rec.tier is not None
                          and rec.tier > rec.home)
        if going_home:  # the owner's hint (`put(..., return_home=True)`): written back behind it
            self.evict(key, rec.home)

    def delete(self, key: str) -> None:
        """Forget `key` and free its memory and swap space; it must not be pinned."""
        with self.state.cond:
            self.state.check_open()
            self._forget(self.state.settled_record(key))
            self.state.cond.notify_all()

    def _forget(self, rec: KeyRecord) -> None:
        """A settled, unpinned key leaves the store: its memory and swap space freed (lock held)."""
        if rec.buffer is not None:
            self.state.free(rec.stable_tier, rec.buffer)
        del self.state.records[rec.key]
        self._versions.forget(rec.key)
        self.state.swap.discard(rec.key)

    def keep(self, keys: Iterable[str]) -> bool:
        """Before their owner changes them in place: keep the present bytes of `keys` aside, all or
        none, until `drop_kept` or `restore_kept` (offload/kept_versions.py [Note: kept versions]).
        Nothing is evicted or written for it: False, and nothing kept, where a dirty key found no
        room for its copy (a copy may leave no less than half a tier's budget free)."""
        return self._versions.keep(keys)

    def drop_kept(self, key: str) -> None:
        """The change to `key` stands: what `keep` kept of it is let go."""
        self._versions.drop(key)

    def restore_kept(self, key: str) -> None:
        """Take the change to `key` back: it holds what `keep` kept again; it must not be pinned."""
        self._versions.restore(key)

    def is_kept(self, key: str) -> bool:
        """`keep` kept bytes of `key` that are neither dropped nor restored yet."""
        return key in self._versions

    def evict(self, key: str, to: Tier = Tier.NVME) -> Handle[None]:
        """Force `key` down to `to` (HOST or NVME), writing it back if dirty; it must not be pinned."""
        to = Tier(to)
        if to == Tier.DEVICE:
            raise ValueError("evict() moves a key down: use to=Tier.HOST or Tier.NVME.")
        with self.state.cond:
            self.state.check_open()
            rec = self.state.settled_record(key)
            if rec.stable_tier <= to:
                return Handle.completed()
            if to == Tier.HOST:
                demoted: Handle[None] = Handle()
                demoted.follow(self._mover.start(rec, Tier.HOST, by_prefetch=False))
                return demoted
            staging: HostBuffer | None = None
            if rec.dirty and not isinstance(rec.buffer, HostBuffer):  # CUDA: stage through HOST
                room = self._room.reserve(Tier.HOST, rec.nbytes, rec)
                assert isinstance(room, HostBuffer)
                staging = room
                rec = self.state.settled_record(key)  # the wait let others in
            done = self._writer.evict_record(rec, demote=False, staging=staging)
            assert done is not None  # with its staging buffer at hand it never needs to wait
            return done

    def flush(self) -> None:
        """Wait until every write issued so far has landed, make them durable, write the index."""
        errors = self._settle_writes()
        self.state.swap.flush()
        if errors:
            raise errors[0]

    def _settle_writes(self) -> list[StorageError]:
        """Wait for every write issued so far; the failures among them (their bytes stayed in memory)."""
        with self.state.cond:
            writes = list(self.state.writes)
        errors = []
        for h in writes:
            try:
                h.wait()
            except StorageError as e:
                errors.append(e)
        with self.state.cond:
            self.state.writes.difference_update(writes)
        return errors

    @property
    def bytes_swapped_out(self) -> int:
        """Bytes written to the swap file so far, those read back and freed since included (cheap,
        unlike `stats()`)."""
        return self.state.engine.counters.bytes_written

    @property
    def zero_copy(self) -> bool:
        """CPU-only: HOST and DEVICE are the same RAM, and a key changes tier without a copy."""
        return self.state.zero_copy

    @property
    def directory(self) -> str:
        """The folder of the swap file (nvme_dir, or a scratch folder)."""
        return self.state.swap.directory

    def stats(self) -> dict:
        """Bytes per tier, I/O totals and seconds, fetch and prefetch counts."""
        return self.state.stats()

    def ram_tier_of(self, key: str) -> Tier | None:
        """On a CPU-only store, the memory tier `key` rests in now; None on NVMe, while it moves, or
        with a GPU. HOST and DEVICE are the same RAM there, so a CPU computation may fetch the key
        where it is instead of moving it, which would only shift budget and evict other keys. A
        hint: the key may move before the fetch, which then brings it back, correctly."""
        with self.state.cond:
            rec = self.state.record(key)
            return rec.tier if self.state.zero_copy and rec.tier in (Tier.HOST, Tier.DEVICE) else None

    def tier_of(self, key: str) -> Tier | None:
        """The tier `key` rests in now (None while it moves): a hint, as `ram_tier_of` is."""
        with self.state.cond:
            return self.state.record(key).tier

    def __contains__(self, key: str) -> bool:
        with self.state.cond:
            return key in self.state.records

    def keys(self) -> list[str]:
        with self.state.cond:
            return list(self.state.records)

    def close(self, *, keep_files: bool = False) -> None:
        """Stop the workers and delete the swap file: it is scratch. `keep_files`: flush first, so
        that the file and its index hold every key (a failed write is then raised)."""
        if self.state.closed:
            return
        forget(self._exit_token)
        try:
            if keep_files:
                self.flush()
            else:  # a write that failed (a full disk) loses nothing: the file goes now
                self._settle_writes()
        finally:
            with self.state.cond:
                self.state.closed = True
                self.state.prefetch.clear()
            self._mover.close()
            self._writer.close()
            self.state.engine.close()
            self.state.swap.close(remove=not keep_files)
            self.state.host.close()
            self.state.dev.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- prefetch ---------------------------------------------------------------------------------

    def _pump_prefetch(self) -> None:
        if not self.state.closed:
            self.state.prefetch.pump(self.state.records, self._start_prefetch, self._prefetch_landed)

    def _start_prefetch(self, rec: KeyRecord, tier: Tier) -> Handle[torch.Tensor]:
        self.state.counts["prefetch_issued"] += 1
        return self._mover.start(rec, tier, by_prefetch=True)

    def _prefetch_landed(self, nbytes: int) -> None:
        with self.state.cond:
            self.state.prefetch.inflight -= nbytes
            self._pump_prefetch()

    # -- helpers ----------------------------------------------------------------------------------

    def _fill(self, buf: Buffer, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        """Copy a caller's tensor in (any device), as `dtype`; lock not held."""
        if isinstance(buf, HostBuffer):
            buf.fill_from(tensor, dtype)  # from CUDA this is a synchronous device-to-host copy
        else:
            self.state.cuda.fill(buf, tensor, dtype)
