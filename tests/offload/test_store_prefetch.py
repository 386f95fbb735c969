import threading
import time

import torch

from offload import Tier


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
            seen.append(store._prefetch.inflight)

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
