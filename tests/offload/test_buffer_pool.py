import os
import re
import threading
import time

import pytest

from outcore.offload.buffer_pool import HostBufferPool
from outcore.offload.errors import OutOfBudgetError
from outcore.offload.io_config import PAGE


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
