"""Long runs hold nothing that grows with the number of steps."""

import torch

from outcore.offload import Tier


def test_finished_writes_are_not_kept_until_flush(make_store):
    store = make_store(host_budget=1 << 20)
    for i in range(200):  # puts and write-backs, never flushed
        store.put(f"k{i % 4}", torch.full((1024,), float(i)), Tier.NVME)
        t = store.fetch(f"k{i % 4}", Tier.HOST).result()
        t.add_(1.0)
        store.release(f"k{i % 4}", dirty=True)
        store.evict(f"k{i % 4}", Tier.NVME).wait()
    assert store.stats()["writes_pending"] <= 2
    assert torch.equal(store.fetch("k3", Tier.HOST).result(), torch.full((1024,), 200.0))
    store.release("k3")
