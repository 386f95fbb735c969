import threading
import time

import torch

from outcore.offload import Tier


def wait_until(cond, timeout=5.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.005)


def test_fetches_of_landed_prefetches_are_hits(make_store):
    store = make_store()
    data = {f"u{i}": torch.randn(20_000) for i in range(6)}
    for k, t in data.items():
        store.put(k, t, Tier.NVME)
    store.flush()
    store.prefetch(list(data), Tier.DEVICE)
    wait_until(lambda: store.stats()["device"]["resident"] == 6 * 80_000)
    for k, t in data.items():
        assert torch.equal(store.fetch(k, Tier.DEVICE).result(), t)
        store.release(k)
    s = store.stats()
    assert s["prefetch_issued"] == 6 and s["prefetch_hits"] == 6 and s["misses"] == 0


def test_in_flight_prefetch_bytes_stay_bounded(make_store):
    limit = 3 * 80_000
    store = make_store(prefetch_bytes=limit)
    for i in range(12):
        store.put(f"u{i}", torch.randn(20_000), Tier.NVME)
    store.flush()
    seen = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(store.state.prefetch.inflight)

    w = threading.Thread(target=watch)
    w.start()
    store.prefetch([f"u{i}" for i in range(12)], Tier.HOST)
    wait_until(lambda: store.stats()["host"]["resident"] == 12 * 80_000)
    stop.set()
    w.join()
    assert max(seen) <= limit and max(seen) > 0


def test_a_fetch_joins_a_prefetch_in_flight(make_store):
    store = make_store()
    t = torch.randn(2_000_000)
    store.put("big", t, Tier.NVME).wait()
    store.prefetch(["big"], Tier.HOST)
    got = store.fetch("big", Tier.HOST).result()
    assert torch.equal(got, t)
    s = store.stats()
    assert s["bytes_read"] <= 8_003_584, "read once, not twice"
    assert s["prefetch_hits"] + s["prefetch_late"] == 1
    store.release("big")


def test_prefetch_without_room_is_dropped_not_an_error(make_store):
    store = make_store(host_budget=96 << 10, device_budget=96 << 10)
    for k in "abc":
        store.put(k, torch.full((10_000,), float(ord(k))), Tier.NVME)
    a = store.fetch("a", Tier.HOST).result()
    b = store.fetch("b", Tier.HOST).result()  # the budget is full of pinned keys
    store.prefetch(["c"], Tier.HOST)
    wait_until(lambda: store.stats()["prefetch_dropped"] == 1)
    assert torch.equal(a, torch.full((10_000,), 97.0)) and b[0] == 98
    store.release("a")
    assert store.fetch("c", Tier.HOST).result()[0] == 99
    store.release("b")
    store.release("c")


def test_a_device_prefetch_waits_for_the_host_prefetch_of_the_same_key(make_store):
    # The engine's two-level prefetch: a unit is read into HOST early and asked onto DEVICE when it
    # comes near; the second request must not be lost while the first read is still in flight.
    store = make_store()
    t = torch.randn(2_000_000)
    store.put("big", t, Tier.NVME).wait()
    store.put("small", torch.ones(1000), Tier.NVME).wait()
    store.prefetch(["big"], Tier.HOST)
    store.prefetch(["big", "small"], Tier.DEVICE)  # "big" is still on its way up: wait, don't block "small"
    wait_until(lambda: store.stats()["device"]["resident"] == 8_000_000 + 4000)
    assert torch.equal(store.fetch("big", Tier.DEVICE).result(), t)
    s = store.stats()
    assert s["bytes_read"] <= 8_003_584 + 4096, "read once, then moved up"
    assert s["misses"] == 0 and s["prefetch_issued"] == 3
    store.release("big")


def _three_keys_on_nvme(store) -> dict[str, torch.Tensor]:
    """Keys "a", "b", "c" of 80,000 bytes each, written to NVMe; returns their values."""
    data = {k: torch.full((20_000,), float(i)) for i, k in enumerate("abc")}
    for k, t in data.items():
        store.put(k, t, Tier.NVME)
    store.flush()
    return data


def test_a_prefetch_never_evicts_an_earlier_prefetch_not_yet_used(make_store):
    # Prefetches are asked for in the order of use: evicting an earlier one to land a later one
    # would only read the earlier one twice.
    store = make_store(host_budget=192 << 10)  # two of these keys (80 KiB each, page-rounded)
    data = _three_keys_on_nvme(store)
    store.prefetch(["a", "b"], Tier.HOST)
    wait_until(lambda: store.stats()["host"]["resident"] == 2 * 80_000)
    store.prefetch(["c"], Tier.HOST)
    wait_until(lambda: store.stats()["prefetch_dropped"] == 1)
    for k in "ab":
        assert torch.equal(store.fetch(k, Tier.HOST).result(), data[k])
        store.release(k)
    s = store.stats()
    assert s["misses"] == 0 and s["prefetch_hits"] == 2 and s["bytes_read"] == 2 * 81_920
    assert torch.equal(store.fetch("c", Tier.HOST).result(), data["c"])  # a fetch may evict them
    store.release("c")


def test_a_prefetch_of_a_key_already_there_keeps_later_prefetches_off_it(make_store):
    # Such a prefetch claims the key as if it had brought it: a later prefetch that needs room
    # evicts another key, not the one about to be used. (Unclaimed, the engine's dirty parameter
    # shards were written back and read again moments after the prefetch that asked for them.)
    store = make_store(host_budget=192 << 10)  # two of these keys (80 KiB each, page-rounded)
    data = _three_keys_on_nvme(store)
    for k in "ab":  # "a" is now the least recently used
        store.fetch(k, Tier.HOST).result()
        store.release(k)
    read = store.stats()["bytes_read"]
    store.prefetch(["a"], Tier.HOST)  # already there
    store.prefetch(["c"], Tier.HOST)  # needs the room of one of them
    wait_until(lambda: store.stats()["bytes_read"] == read + 81_920 and store.stats()["evictions"] == 1)
    misses = store.stats()["misses"]
    assert torch.equal(store.fetch("a", Tier.HOST).result(), data["a"])
    store.release("a")
    s = store.stats()
    assert s["misses"] == misses and s["bytes_read"] == read + 81_920 and s["prefetch_dropped"] == 0
    assert torch.equal(store.fetch("b", Tier.HOST).result(), data["b"])  # "b" made the room
    store.release("b")
    assert store.stats()["misses"] == misses + 1


def test_a_prefetch_waits_for_room_a_write_back_is_freeing(make_store, held_writes):
    store = make_store(host_budget=192 << 10)
    store.put("c", torch.full((20_000,), 3.0), Tier.NVME).wait()
    for k in "ab":
        store.put(k, torch.full((20_000,), 1.0), Tier.HOST)  # dirty: leaving HOST means a write
    held_writes.hold()
    evicted = store.evict("a", Tier.NVME)
    assert held_writes.writing.wait(10)
    store.prefetch(["c"], Tier.HOST)  # no room until "a" is written: wait for it, don't drop
    time.sleep(0.2)
    assert store.stats()["prefetch_dropped"] == 0
    held_writes.release()
    evicted.wait()
    wait_until(lambda: store.stats()["host"]["resident"] == 2 * 80_000)
    assert torch.equal(store.fetch("c", Tier.HOST).result(), torch.full((20_000,), 3.0))
    s = store.stats()
    assert s["prefetch_hits"] == 1 and s["prefetch_dropped"] == 0
    store.release("c")


def test_a_prefetch_never_takes_room_a_waiting_fetch_needs(make_store, held_writes):
    # Small prefetches landing one after another would otherwise keep a large fetch waiting for as
    # long as they come (the forward once waited 1.1 s for its embedding this way).
    store = make_store(host_budget=4 * 81_920)
    store.put("big", torch.full((40_000,), 5.0), Tier.NVME)
    store.put("small", torch.full((20_000,), 6.0), Tier.NVME)
    store.flush()
    for k in ("p", "q", "dirty"):
        store.put(k, torch.full((20_000,), 1.0), Tier.HOST)
    pinned = [store.fetch(k, Tier.HOST).result() for k in ("p", "q")]
    held_writes.hold()
    big = store.fetch("big", Tier.HOST)  # one slot free, one on its way out ("dirty" is written)
    assert held_writes.writing.wait(10)
    wait_until(lambda: store.state.demand_waiting[Tier.HOST] == 1)
    store.prefetch(["small"], Tier.HOST)  # fits in the free slot, but that slot is the fetch's
    wait_until(lambda: store.stats()["prefetch_dropped"] == 1)
    held_writes.release()
    assert torch.equal(big.result(timeout=10), torch.full((40_000,), 5.0))
    assert store.stats()["bytes_read"] == 163_840  # only the fetch was read
    store.release("big")
    for k in ("p", "q"):
        store.release(k)
    del pinned
