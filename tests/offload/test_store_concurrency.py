import random
import threading

import pytest
import torch

from outcore.offload import IOConfig, OutOfBudgetError, Tier


# The second config has fewer I/O slots than a key has blocks: write-backs must never wait for a
# slot while holding the store's lock (see [Note: no I/O under the lock]).
@pytest.mark.slow
@pytest.mark.parametrize("io", [IOConfig(block_size=8 << 10, queue_depth=4, threads=3),
                                IOConfig(block_size=4096, queue_depth=1, threads=1)])
def test_threads_fetching_evicting_and_writing_concurrently(make_store, io):
    # Budgets hold about 4 of the 12 keys, so threads constantly evict each other's released keys.
    store = make_store(host_budget=200 << 10, device_budget=160 << 10, wait_timeout=10, io=io)
    shared = {f"s{i}": torch.randn(10_000) for i in range(8)}
    for k, t in shared.items():
        store.put(k, t, Tier.NVME)
    errors = []

    def worker(wid: int) -> None:
        rng = random.Random(wid)
        own = f"own{wid}"
        value = torch.zeros(10_000)
        store.put(own, value, Tier.HOST)
        try:
            for _ in range(150):
                op = rng.random()
                tier = rng.choice([Tier.HOST, Tier.DEVICE])
                if op < 0.5:
                    k = rng.choice(list(shared))
                    try:
                        got = store.fetch(k, tier).result()
                    except ValueError:
                        continue  # pinned in the other tier by another thread: a clear refusal
                    assert torch.equal(got, shared[k]), k
                    store.release(k)
                elif op < 0.8:
                    got = store.fetch(own, tier).result()
                    assert torch.equal(got, value), own
                    got += 1
                    value += 1
                    store.release(own, dirty=True)
                else:
                    k = rng.choice(list(shared) + [own])
                    try:
                        store.evict(k, rng.choice([Tier.HOST, Tier.NVME])).wait()
                    except ValueError:
                        pass  # pinned by another thread
            assert torch.equal(store.fetch(own, Tier.HOST).result(), value)
            store.release(own)
        except (AssertionError, OutOfBudgetError) as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    s = store.stats()
    assert s["host"]["peak"] <= 200 << 10 and s["device"]["peak"] <= 160 << 10
    assert s["evictions"] > 0 and s["writebacks"] > 0
