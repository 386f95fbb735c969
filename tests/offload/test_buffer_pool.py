import ctypes
import ctypes.util
import os
import random
import re
import threading
import time

import pytest

from outcore.offload.buffer_pool import HostBufferPool, PinnedBufferPool
from outcore.offload.errors import OutOfBudgetError
from outcore.offload.host_arena import ArenaBuffer, HostArena
from outcore.offload.io_config import PAGE

linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only: reads /proc/self/smaps")


def test_buffers_are_page_aligned_and_rounded():
    pool = HostBufferPool(1 << 20)
    buf = pool.acquire(1)
    assert buf.capacity == PAGE
    assert buf.tensor.data_ptr() % PAGE == 0
    assert pool.in_use == PAGE


def _mapping_of(address: int) -> tuple[str, list[str]]:
    """Permissions and VmFlags of the mapping in /proc/self/smaps that holds `address`."""
    perms, flags, inside = None, None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head[0]):
                if inside:
                    break
                start, end = (int(x, 16) for x in head[0].split("-"))
                inside, perms = start <= address < end, head[1]
            elif inside and head[0] == "VmFlags:":
                flags = head[1:]
    assert inside, "the buffer's mapping is not in /proc/self/smaps"
    return perms, flags or []


def _resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of [address, address + nbytes) in RAM now (mincore(2): exact for the range, where a
    mapping's Rss in smaps may cover neighbouring memory the kernel merged into it)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    pages = -(-nbytes // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * PAGE


@linux_only
def test_host_buffers_are_private_mappings_that_ask_for_huge_pages():
    # A shared anonymous mapping is shmem: it never gets transparent huge pages on a default
    # machine, and refilling such buffers every step cost 4 KiB page faults and zeroing.
    buf = HostBufferPool(8 << 20).acquire(8 << 20)
    buf.tensor.fill_(1)
    perms, flags = _mapping_of(buf.tensor.data_ptr())
    assert perms == "rw-p", f"host buffer mapping is {perms!r}, not private"
    assert "hg" in flags, "MADV_HUGEPAGE was not asked for"


def test_freed_memory_is_reused_without_touching_new_pages():
    pool = HostBufferPool(4 * PAGE)
    bufs = [pool.acquire(PAGE) for _ in range(4)]
    assert pool.try_acquire(PAGE) is None
    for i, b in enumerate(bufs):
        b.tensor.fill_(i + 1)
        pool.release(b)
    assert pool.in_use == 0 and pool.arena.touched_free == 4 * PAGE
    again = [pool.acquire(PAGE) for _ in range(4)]
    assert pool.arena.first_touched == 4 * PAGE, "freed pages must be reused, not new ones touched"
    assert {b.tensor.data_ptr() for b in again} == {b.tensor.data_ptr() for b in bufs}
    assert pool.peak <= pool.budget


def test_a_request_takes_the_smallest_touched_run_that_fits():
    arena = HostArena(8 * PAGE)
    small, gap, large = arena.take(PAGE), arena.take(PAGE), arena.take(3 * PAGE)
    arena.give_back(small)
    arena.give_back(large)  # touched runs of 1 and 3 pages, apart
    assert isinstance(gap, ArenaBuffer)
    one = arena.take(PAGE)
    three = arena.take(3 * PAGE)
    assert (one.tensor.data_ptr(), three.tensor.data_ptr()) == (small.tensor.data_ptr(), large.tensor.data_ptr())
    assert arena.first_touched == 5 * PAGE


def test_scattered_free_pages_go_back_to_the_os_before_new_ones_are_touched():
    arena = HostArena(4 * PAGE)
    bufs = [arena.take(PAGE) for _ in range(4)]
    for b in bufs[::2]:
        b.tensor.fill_(7)
        arena.give_back(b)  # two touched pages, not adjacent: no two-page run is touched
    two = arena.take(2 * PAGE)
    assert two is not None and arena.touched_free == 0  # both freed pages went back first
    assert arena.in_use + arena.touched_free + arena.apart <= arena.capacity
    for b in bufs[::2]:  # the released pages read zeros again, as any fresh page
        assert int(arena._mapping[b.offset : b.offset + PAGE].sum()) == 0


@linux_only
def test_random_traffic_keeps_buffers_apart_intact_and_resident_memory_bounded():
    """Buffers of mixed sizes taken and given back at random: no two live buffers overlap, each
    keeps its bytes, and the arena's mapping never holds more than the capacity in RAM."""
    rng = random.Random(0)
    capacity = 64 * PAGE
    arena = HostArena(capacity)
    live: list[tuple[object, int]] = []
    for step in range(400):
        if live and (rng.random() < 0.45 or arena.in_use + arena.apart > capacity // 2):
            buf, mark = live.pop(rng.randrange(len(live)))
            assert bool((buf.tensor == mark).all()), "a live buffer's bytes changed"
            arena.give_back(buf)
        else:
            size = rng.choice([1, 2, 3, 5, 8, 13]) * PAGE
            buf = arena.take(size)
            assert buf is not None
            mark = step % 250 + 1
            buf.tensor.fill_(mark)
            live.append((buf, mark))
        spans = sorted((b.tensor.data_ptr(), b.tensor.data_ptr() + b.capacity) for b, _ in live)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
        assert arena.in_use + arena.touched_free + arena.apart <= capacity
        if step % 20 == 0:
            rss = _resident_bytes(arena._mapping.ctypes.data, arena._mapping.nbytes)
            assert rss <= capacity - arena.apart, f"the arena holds {rss:,} bytes in RAM"
    assert arena.first_touched <= 2 * capacity, "after the first fill, requests reuse touched pages"


def test_two_pools_share_one_arena_and_a_buffer_changes_tier_without_a_copy():
    arena = HostArena(3 * PAGE)
    host, dev = HostBufferPool(2 * PAGE, arena=arena), HostBufferPool(PAGE, name="DEVICE", arena=arena)
    buf = host.acquire(PAGE)
    buf.tensor[:4] = 7
    assert dev.try_adopt(buf)
    host.detach(buf)
    assert host.in_use == 0 and dev.in_use == PAGE and int(buf.tensor[0]) == 7
    other = host.acquire(PAGE)
    assert not dev.try_adopt(other), "adopt must respect the budget"
    dev.release(buf)
    assert arena.in_use == PAGE and arena.touched_free == PAGE


def test_a_buffer_adopted_across_arenas_goes_back_to_its_own():
    host, dev = HostBufferPool(2 * PAGE), HostBufferPool(2 * PAGE, name="DEVICE")  # an arena each
    buf = host.acquire(2 * PAGE)
    assert dev.try_adopt(buf)
    host.detach(buf)
    dev.release(buf)
    assert host.arena.in_use == 0 and host.arena.touched_free == 2 * PAGE and dev.arena.in_use == 0
    assert host.acquire(2 * PAGE).tensor.data_ptr() == buf.tensor.data_ptr()


def test_acquire_waits_for_a_release_then_times_out():
    pool = HostBufferPool(2 * PAGE)
    held = pool.acquire(2 * PAGE)
    threading.Timer(0.1, pool.release, args=(held,)).start()
    t0 = time.monotonic()
    got = pool.acquire(2 * PAGE, timeout=5)
    assert time.monotonic() - t0 >= 0.05 and got.capacity == 2 * PAGE
    with pytest.raises(OutOfBudgetError, match="HOST budget"):
        pool.acquire(PAGE, timeout=0.1)


def test_larger_than_budget_fails_at_once():
    pool = HostBufferPool(PAGE)
    with pytest.raises(OutOfBudgetError, match="larger than the whole budget"):
        pool.try_acquire(PAGE + 1)


def test_trim_gives_every_free_page_back():
    pool = HostBufferPool(4 * PAGE)
    pool.release(pool.acquire(4 * PAGE))
    pool.trim()
    assert pool.arena.touched_free == 0 and pool.in_use == 0


# -- the page-locked pool of a GPU's HOST tier (its caching runs without CUDA too) ----------------

def test_pinned_pool_reuses_freed_buffers_of_the_same_size():
    pool = PinnedBufferPool(4 * PAGE)
    bufs = [pool.acquire(PAGE) for _ in range(4)]
    assert pool.try_acquire(PAGE) is None
    for b in bufs:
        pool.release(b)
    assert pool.in_use == 0 and pool.cached == 4 * PAGE
    again = [pool.acquire(PAGE) for _ in range(4)]
    assert pool.allocations == 4, "freed buffers must be reused"
    assert {id(b) for b in again} == {id(b) for b in bufs}
    assert pool.peak <= pool.budget


def test_pinned_pool_drops_cached_buffers_of_other_sizes_to_make_room():
    pool = PinnedBufferPool(4 * PAGE)
    pool.release(pool.acquire(3 * PAGE))
    big = pool.acquire(4 * PAGE)
    assert big.capacity == 4 * PAGE and pool.cached == 0 and pool.in_use == 4 * PAGE
