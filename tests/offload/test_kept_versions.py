"""A key's earlier bytes kept aside while its owner changes it (offload/kept_versions.py): kept in
the swap file where a clean key lies (nothing read or written for it), copied into free HOST memory
where it is dirty, refused where there is no room; dropped (the change stands) or restored (the key
is what it was, however often it was written since)."""

import torch

from outcore.offload import Tier, TieredStore

N = 4096  # fp32 elements: 16 KiB a key


def change(store: TieredStore, key: str, value: float) -> None:
    t = store.fetch_now(key, Tier.HOST)
    t.fill_(value)
    store.release(key, dirty=True)


def value_of(store: TieredStore, key: str) -> torch.Tensor:
    t = store.fetch_now(key, Tier.HOST).clone()
    store.release(key)
    return t


def test_a_clean_key_is_kept_in_the_swap_file_with_no_byte_moved(tmp_path):
    with TieredStore(str(tmp_path), host_budget=1 << 20, device_budget=1 << 20) as store:
        old = torch.randn(N)
        store.put("k", old).wait()
        value_of(store, "k")  # in memory, clean
        before = store.stats()
        assert store.keep(["k"])
        after = store.stats()
        assert (after["bytes_read"], after["bytes_written"]) == (before["bytes_read"], before["bytes_written"])
        assert after["host"]["in_use"] == before["host"]["in_use"]
        change(store, "k", 1.0)
        store.evict("k").wait()  # the change written: to a fresh extent, the kept one untouched
        change(store, "k", 2.0)
        store.evict("k").wait()
        assert store.stats()["nvme"]["bytes"] == 2 * N * 4  # the kept bytes and the latest
        store.restore_kept("k")
        assert torch.equal(value_of(store, "k"), old)
        assert store.stats()["nvme"]["bytes"] == N * 4


def test_a_dropped_version_lets_the_change_stand_and_its_extent_go(tmp_path):
    with TieredStore(str(tmp_path), host_budget=1 << 20, device_budget=1 << 20) as store:
        store.put("k", torch.zeros(N)).wait()
        assert store.keep(["k"])  # resting on NVMe: kept where it lies
        change(store, "k", 3.0)
        store.evict("k").wait()
        store.drop_kept("k")
        assert store.stats()["nvme"]["bytes"] == N * 4
        assert torch.equal(value_of(store, "k"), torch.full((N,), 3.0))
        assert not store.is_kept("k")


def test_a_dirty_key_is_copied_into_free_host_memory_and_restored_from_it(tmp_path):
    with TieredStore(str(tmp_path), host_budget=1 << 20, device_budget=1 << 20) as store:
        old = torch.randn(N)
        store.put("k", old, Tier.HOST)  # dirty: the swap file has no bytes of it
        in_use = store.stats()["host"]["in_use"]
        assert store.keep(["k"])
        assert store.stats()["host"]["in_use"] == in_use + N * 4
        assert store.stats()["bytes_written"] == 0
        change(store, "k", 5.0)
        store.restore_kept("k")
        assert torch.equal(value_of(store, "k"), old)
        assert store.stats()["host"]["in_use"] == in_use  # the change's buffer freed, the copy is the key's
        change(store, "k", 6.0)  # and it is an ordinary key again
        store.evict("k").wait()
        assert torch.equal(value_of(store, "k"), torch.full((N,), 6.0))


def test_a_copy_takes_no_room_the_working_set_needs_keeps_nothing_and_evicts_nothing(tmp_path):
    """A copy is taken only while more than half the budget of its tier stays free beside it."""
    with TieredStore(str(tmp_path), host_budget=4 * N * 4, device_budget=N * 4) as store:  # DEVICE: no room
        store.put("clean", torch.ones(N)).wait()
        for key in ("a", "b"):
            store.put(key, torch.randn(N), Tier.HOST)  # dirty: the swap file has no bytes of them
        written = store.stats()["bytes_written"]
        assert not store.keep(["clean", "a"])  # a copy of "a" would leave a quarter free
        assert not store.is_kept("clean")  # all or none
        assert store.stats()["evictions"] == 0 and store.stats()["bytes_written"] == written
        store.delete("b")
        assert store.keep(["clean", "a"])  # half stays free
        store.delete("a")  # a key that leaves takes its kept copy with it
        assert store.stats()["host"]["in_use"] == 0
        store.drop_kept("clean")


def test_a_put_replaces_what_was_kept(tmp_path):
    with TieredStore(str(tmp_path), host_budget=1 << 20, device_budget=1 << 20) as store:
        store.put("k", torch.zeros(N)).wait()
        assert store.keep(["k"])
        store.put("k", torch.ones(N)).wait()
        assert not store.is_kept("k")
        assert store.stats()["nvme"]["bytes"] == N * 4
