"""Earlier bytes of keys kept aside while their owner changes them: `TieredStore.keep`.

[Note: kept versions] An owner that may have to take a change back (a speculative update, runtime/
update_stream.py [Note: speculative clipping]) asks the store to keep a key's present bytes before
it changes the key in place. A key that is not dirty has those bytes in the swap file already
([Note: residency]), and keeping them there costs nothing: the swap file writes every new version
of a key to a fresh extent (offload/swap_file.py), and the kept extent is simply not reused until
the owner decides. A dirty key is copied into free HOST memory (on a CPU-only machine, DEVICE's
too: it is RAM as well), never by evicting anything, and only while more than half the tier's
budget stays free beside the copy: held until the owner decides,
a copy in the room the working set is about to need would push the keys it needs next out, each
written and read back (docs/benchmarks.md). Where there is no such room, nothing is kept and
`keep` says so, so that the owner can take another way.
The owner then either drops the kept bytes (its change stands) or restores them (the key is again
what it was, and whatever was written of it since is forgotten).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from outcore.offload.buffers import HostBuffer
from outcore.offload.errors import StorageError
from outcore.offload.io_config import round_up
from outcore.offload.residency import STABLE, KeyRecord, Residency, Tier
from outcore.offload.store_state import StoreState


class KeptVersions:
    """The kept bytes of a store's keys: in its swap file (None), or a copy in a memory tier."""

    def __init__(self, core: StoreState) -> None:
        self._core = core
        self._kept: dict[str, tuple[Tier, HostBuffer] | None] = {}

    def keep(self, keys: Iterable[str]) -> bool:
        """Keep each key's present bytes aside, all or none; False where a dirty key found no free
        HOST memory for its copy (then nothing is kept)."""
        core = self._core
        with core.cond:
            core.check_open()
            taken: list[str] = []
            for key in keys:
                if key in self._kept:
                    continue
                rec = self._written_back(key)
                assert rec.source is None, f"{key!r} is read from files outcore does not own: never changed"
                if not rec.dirty and core.swap.entry(key) is not None:
                    core.swap.keep(key)
                    self._kept[key] = None
                else:
                    copy = self._copy(rec)
                    if copy is None:
                        for k in taken:
                            self._drop(k)
                        return False
                    self._kept[key] = copy
                taken.append(key)
            return True

    def _written_back(self, key: str) -> KeyRecord:
        """The key's record once a write-back in flight has landed (lock held): its bytes are then
        in the swap file, and keeping them there costs nothing, whatever the timing."""
        core = self._core
        deadline = time.monotonic() + core.wait_timeout
        rec = core.record(key)
        while rec.state == Residency.TO_NVME:
            if time.monotonic() > deadline:
                raise StorageError(f"key {key!r} stayed in flight for {core.wait_timeout:.0f} s")
            core.cond.wait(0.05)
            rec = core.record(key)
        return rec

    def drop(self, key: str) -> None:
        """The change stands: the kept bytes of `key` are let go."""
        with self._core.cond:
            self._drop(key)

    def restore(self, key: str) -> None:
        """Take the change back: `key` holds its kept bytes again (it must not be pinned)."""
        core = self._core
        with core.cond:
            rec = core.settled_record(key)
            copy = self._kept.pop(key)
            if rec.buffer is not None:
                core.free(rec.stable_tier, rec.buffer)
            buffer = None
            if copy is None:
                core.swap.restore_kept(key)
                state, dirty = Residency.NVME, False
            else:
                core.swap.discard(key)  # a copy of the change, if it was written
                (tier, buffer), dirty = copy, True
                state = STABLE[tier]
            core.records[key] = KeyRecord(key, rec.nbytes, rec.dtype, rec.shape, state, buffer=buffer, dirty=dirty,
                                           home=rec.home, return_home=rec.return_home)
            core.cond.notify_all()

    def forget(self, key: str) -> None:
        """`key` leaves the store or is replaced: whatever was kept of it goes too (lock held)."""
        if key in self._kept:
            self._drop(key)

    def __contains__(self, key: str) -> bool:
        with self._core.cond:
            return key in self._kept

    def _drop(self, key: str) -> None:
        copy = self._kept.pop(key)
        if copy is None:
            self._core.swap.drop_kept(key)
        else:
            self._core.free(*copy)

    def _copy(self, rec: KeyRecord) -> tuple[Tier, HostBuffer] | None:
        """A copy of a dirty key's bytes in free memory: HOST's, or on a CPU-only store (where
        DEVICE is RAM too) DEVICE's; None where neither has room enough (or the bytes are not in
        memory yet: a put still being filled)."""
        core, source = self._core, rec.buffer
        if source is None:
            return None
        for tier in (Tier.HOST, Tier.DEVICE) if core.zero_copy else (Tier.HOST,):
            pool = core.mem[tier]
            if pool.available() - round_up(rec.nbytes) < pool.budget // 2:  # room the working set needs
                continue
            copy = pool.try_acquire(rec.nbytes)
            if not isinstance(copy, HostBuffer):
                continue
            if isinstance(source, HostBuffer):
                copy.tensor[: rec.nbytes].copy_(source.tensor[: rec.nbytes])
            else:
                core.cuda.to_host(source, copy, rec.nbytes)
            return tier, copy
        return None
