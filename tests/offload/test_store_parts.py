"""The store's parts, each built and tested alone over a `StoreState`: the room with a stand-in
writer, the writer, the mover; and the one completion handle they all return."""

import threading

import pytest
import torch

from outcore.offload.errors import OutOfBudgetError
from outcore.offload.handle import Handle
from outcore.offload.io_config import IOConfig
from outcore.offload.mover import Mover
from outcore.offload.residency import KeyRecord, Residency, Tier
from outcore.offload.room import Room
from outcore.offload.store_state import StoreState
from outcore.offload.writer import Writer

MIB = 1 << 20


@pytest.fixture
def state(tmp_path):
    s = StoreState(str(tmp_path / "nvme"), "cpu", 4 * MIB, 4 * MIB, IOConfig(threads=2, block_size=1 << 18),
                   rank=0, nvme_preallocate=0, prefetch_bytes=None, wait_timeout=0.5)
    yield s
    s.swap.close(remove=True)
    s.engine.close()


def resident(state, key, tier=Tier.HOST, nbytes=MIB, dirty=False):
    """A released key resting in `tier`'s memory, as a landed fetch leaves it."""
    rec = KeyRecord(key, nbytes, torch.uint8, (nbytes,), Residency.HOST if tier == Tier.HOST else Residency.DEVICE,
                    dirty=dirty)
    with state.cond:
        rec.buffer = state.mem[tier].try_acquire(nbytes)
        assert rec.buffer is not None
        state.records[key] = rec
    return rec


class FreesOldest:
    """A stand-in writer: evicts by dropping the victim's buffer, and counts what it was asked."""

    def __init__(self, state):
        self.state, self.asked = state, []

    def evict_record(self, rec, *, demote, staging=None):
        self.asked.append(rec.key)
        self.state.free(rec.stable_tier, rec.held)
        rec.buffer = None
        rec.to(Residency.NVME)
        return Handle.completed()


def test_the_room_asks_its_writer_to_evict_and_never_exceeds_the_budget(state):
    writer = FreesOldest(state)
    room = Room(state, writer)
    for i in range(4):
        resident(state, f"k{i}")
        state.records[f"k{i}"].last_use = i
    new = KeyRecord("new", MIB, torch.uint8, (MIB,), Residency.TO_HOST)
    buf = room.reserve(Tier.HOST, MIB, new)
    assert buf.capacity == MIB and writer.asked == ["k0"]  # the least recently used, and only it
    assert state.host.in_use == 4 * MIB


def test_the_room_gives_up_after_its_wait_saying_what_stays_pinned(state):
    for i in range(4):
        resident(state, f"k{i}").pins = 1  # nothing may leave
    room = Room(state, FreesOldest(state))
    with pytest.raises(OutOfBudgetError, match="4,194,304 bytes stay pinned in HOST"):
        room.reserve(Tier.HOST, MIB, KeyRecord("new", MIB, torch.uint8, (MIB,), Residency.TO_HOST))


def test_the_writer_drops_a_clean_key_and_writes_a_dirty_one_back(state):
    writer = Writer(state)
    try:
        clean, dirty = resident(state, "clean"), resident(state, "dirty", dirty=True)
        dirty.held.tensor[:MIB].fill_(7)
        with state.cond:
            assert writer.evict_record(clean, demote=False).done()
            handle = writer.evict_record(dirty, demote=False)
        assert clean.state is Residency.NVME and state.host.in_use == MIB
        handle.wait(5)
        assert dirty.state is Residency.NVME and not dirty.dirty and state.host.in_use == 0
        assert state.counts["writebacks"] == 1 and state.swap.entry("dirty") is not None
    finally:
        writer.close()


def test_the_mover_reads_a_key_back_and_a_second_fetch_joins_the_move(state):
    writer = Writer(state)
    mover = Mover(state, Room(state, writer))
    try:
        rec = resident(state, "k", dirty=True)
        rec.held.tensor[:MIB].copy_(torch.arange(MIB, dtype=torch.int64).to(torch.uint8))
        with state.cond:
            written = writer.evict_record(rec, demote=False)
        written.wait(5)  # (its landing takes the lock)
        with state.cond:
            first = mover.bring(rec, Tier.DEVICE, count=True)
            second = mover.bring(rec, Tier.DEVICE, count=True)
        assert second is first  # one move, joined
        got = first.result(5)
        assert torch.equal(got, torch.arange(MIB, dtype=torch.int64).to(torch.uint8))
        assert rec.state is Residency.DEVICE and state.counts["misses"] == 2
        with state.cond:
            assert mover.bring(rec, Tier.DEVICE, count=True).result() is not None  # resident: a hit
        assert state.counts["hits"] == 1
    finally:
        mover.close()
        writer.close()


def test_a_handle_gives_its_value_or_its_error_to_waiters_callbacks_and_followers():
    h: Handle[int] = Handle()
    seen, follower = [], Handle()
    h.add_done_callback(lambda d: seen.append(d.result()))
    follower.follow(h)
    threading.Timer(0.05, h.set_result, args=(42,)).start()
    assert h.result(5) == 42 and follower.result(5) == 42 and seen == [42]
    failed: Handle[None] = Handle()
    failed.set_exception(ValueError("no"))
    with pytest.raises(ValueError, match="no"):
        failed.wait()
    assert isinstance(failed.exception(), ValueError)
    with pytest.raises(TimeoutError):
        Handle().wait(0.01)
    with pytest.raises(AssertionError, match="completed twice"):
        h.set_result(1)
