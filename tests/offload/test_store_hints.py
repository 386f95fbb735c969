"""The `return_home` hint: a key that visits memory only to be changed goes back once released dirty."""

import torch

from outcore.offload import Tier


def test_a_key_put_with_return_home_goes_back_to_its_tier_after_a_dirty_release(make_store):
    store = make_store()
    store.put("state", torch.zeros(4096), Tier.NVME, return_home=True)
    store.put("cached", torch.zeros(4096), Tier.NVME)
    store.flush()
    for key in ("state", "cached"):
        store.fetch(key, Tier.HOST).result().add_(1.0)
        store.release(key, dirty=True)
    store.flush()  # waits for the write-back the hint started
    assert store.stats()["writebacks"] == 1
    assert store.stats()["host"]["resident"] == 4096 * 4  # only the key without the hint stayed
    assert torch.equal(store.fetch("state", Tier.HOST).result(), torch.ones(4096))  # read back from NVMe
    store.release("state")


def test_a_clean_release_or_a_key_still_pinned_stays_put(make_store):
    store = make_store()
    store.put("state", torch.zeros(4096), Tier.NVME, return_home=True)
    store.fetch("state", Tier.HOST).result()
    store.release("state")  # read, not changed: nothing to write
    a = store.fetch("state", Tier.HOST).result()
    b = store.fetch("state", Tier.HOST).result()
    a.add_(1.0)
    store.release("state", dirty=True)  # the other fetch still holds it
    assert store.stats()["writebacks"] == 0 and store.stats()["host"]["resident"] == 4096 * 4
    del b
    store.release("state")  # clean: the key stays (dirty) where it is, as any cached key does
    store.flush()
    assert store.stats()["writebacks"] == 0 and store.stats()["host"]["resident"] == 4096 * 4


def test_a_key_put_in_host_with_the_hint_returns_there_from_device(make_store):
    store = make_store()
    store.put("p", torch.zeros(1024), Tier.HOST, return_home=True)
    store.fetch("p", Tier.DEVICE).result().add_(2.0)
    store.release("p", dirty=True)
    s = store.stats()
    assert s["host"]["resident"] == 1024 * 4 and s["device"]["resident"] == 0
    assert torch.equal(store.fetch("p", Tier.HOST).result(), torch.full((1024,), 2.0))
    store.release("p")
