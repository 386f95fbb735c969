import os
import re
import resource
import threading
import time

import pytest

from offload.buffer_pool import HostBufferPool
from offload.errors import OutOfBudgetError
from offload.io_config import PAGE


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


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only: reads /proc/self/smaps")
def test_host_buffers_are_private_mappings_that_ask_for_huge_pages():
    # A shared anonymous mapping is shmem: it never gets transparent huge pages on a default
    # machine, and refilling such buffers every step cost 4 KiB page faults and zeroing.
    buf = HostBufferPool(8 << 20).acquire(8 << 20)
    buf.tensor.fill_(1)
    perms, flags = _mapping_of(buf.tensor.data_ptr())
    assert perms == "rw-p", f"host buffer mapping is {perms!r}, not private"
    assert "hg" in flags, "MADV_HUGEPAGE was not asked for"


def test_budget_is_never_exceeded_and_reuse_avoids_new_allocations():
    pool = HostBufferPool(4 * PAGE)
    bufs = [pool.acquire(PAGE) for _ in range(4)]
    assert pool.try_acquire(PAGE) is None
    for b in bufs:
        pool.release(b)
    assert pool.in_use == 0 and pool.cached == 4 * PAGE
    again = [pool.acquire(PAGE) for _ in range(4)]
    assert pool.allocations == 4, "freed buffers must be reused"
    assert {id(b) for b in again} == {id(b) for b in bufs}
    assert pool.peak <= pool.budget


def test_cached_buffers_of_other_sizes_are_dropped_to_make_room():
    pool = HostBufferPool(4 * PAGE)
    pool.release(pool.acquire(3 * PAGE))
    big = pool.acquire(4 * PAGE)
    assert big.capacity == 4 * PAGE and pool.cached == 0 and pool.in_use == 4 * PAGE


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


def test_detach_and_adopt_move_accounting_without_copying():
    host, dev = HostBufferPool(2 * PAGE), HostBufferPool(PAGE, name="DEVICE")
    buf = host.acquire(PAGE)
    buf.tensor[:4] = 7
    assert dev.try_adopt(buf)
    host.detach(buf)
    assert host.in_use == 0 and dev.in_use == PAGE and int(buf.tensor[0]) == 7
    other = host.acquire(PAGE)
    assert not dev.try_adopt(other), "adopt must respect the budget"


def _thread_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


@pytest.mark.skipif(not hasattr(resource, "RUSAGE_THREAD"), reason="Linux only: counts this thread's page faults")
def test_a_new_size_reshapes_a_cached_buffer_whose_pages_cost_no_fault():
    pool = HostBufferPool(16 << 20)
    buf = pool.acquire(8 << 20)
    buf.tensor.fill_(1)  # in memory now
    pool.release(buf)
    small = pool.acquire(4 << 20)
    assert small is buf and small.capacity == 4 << 20
    assert (pool.allocations, pool.recycled, pool.in_use, pool.cached) == (1, 1, 4 << 20, 0)
    before = _thread_faults()
    small.tensor.fill_(2)
    assert _thread_faults() == before, "the kept pages were faulted in again"
    fresh = HostBufferPool(16 << 20).acquire(4 << 20)
    before = _thread_faults()
    fresh.tensor.fill_(2)
    assert _thread_faults() > before, "a new mapping should fault: the check above proves nothing"
    pool.release(small)
    grown = pool.acquire(12 << 20)  # grows: the old pages move along, the rest is new
    assert grown is buf and grown.capacity == 12 << 20 and pool.allocations == 1
    grown.tensor.fill_(3)
    assert int(grown.tensor[0]) == 3 and int(grown.tensor[-1]) == 3


def test_a_cached_buffer_still_viewed_elsewhere_is_never_reshaped():
    pool = HostBufferPool(8 * PAGE)
    buf = pool.acquire(4 * PAGE)
    view = buf.tensor[:PAGE]
    view.fill_(5)
    pool.release(buf)  # a caller's bug, say, keeps `view`: its memory must stay valid
    other = pool.acquire(2 * PAGE)
    assert other is not buf and (pool.allocations, pool.recycled) == (2, 0)
    assert int(view[0]) == 5 and int(view[-1]) == 5
    assert pool.in_use == 2 * PAGE and pool.cached == 0


def test_a_pool_recycles_its_siblings_cached_buffers_within_both_budgets():
    host, dev = HostBufferPool(4 * PAGE), HostBufferPool(4 * PAGE, name="DEVICE")
    host.sibling, dev.sibling = dev, host
    dev.release(dev.acquire(3 * PAGE))
    got = host.acquire(2 * PAGE)
    assert (host.allocations, host.recycled, host.in_use) == (0, 1, 2 * PAGE)
    assert dev.cached == 0 and dev.in_use == 0
    assert HostBufferPool(4 * PAGE, pin=True).give_cached(PAGE) is None
    assert got.capacity == 2 * PAGE


def test_pinned_pools_drop_and_map_rather_than_reshape():
    pool = HostBufferPool(8 * PAGE, pin=True)  # (on a machine without CUDA nothing is really pinned)
    pool.release(pool.acquire(4 * PAGE))
    pool.acquire(2 * PAGE)
    assert (pool.allocations, pool.recycled) == (2, 0)
