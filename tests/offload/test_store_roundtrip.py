"""Conformance: every tier and every backend returns exactly the bytes that were put."""

import json
import os
import stat

import pytest
import torch

from outcore.offload import IOConfig, Tier

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn]
SIZES = [1, 3, 1023, 4097, 100_003]


def sample(dtype, n):
    if dtype == torch.bool:
        return torch.rand(n) > 0.5
    if dtype.is_floating_point and dtype.itemsize == 1:
        return torch.randn(n).to(dtype)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(n, dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), dtype=dtype)


def same_bytes(a, b):
    as_bytes = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731 - bitwise, so NaNs compare too
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


@pytest.mark.parametrize("backend", ["threads", "aiofiles"])
@pytest.mark.parametrize("put_tier", [Tier.NVME, Tier.HOST, Tier.DEVICE])
def test_every_dtype_and_odd_size_round_trips(make_store, backend, put_tier):
    store = make_store(io=IOConfig(block_size=16 << 10, queue_depth=8, threads=2, backend=backend))
    tensors = {f"{dt}-{n}": sample(dt, n) for dt in DTYPES for n in SIZES}
    for k, t in tensors.items():
        store.put(k, t, put_tier)
    for k in tensors:
        store.evict(k, Tier.NVME).wait()
    store.flush()
    for fetch_tier in (Tier.HOST, Tier.DEVICE):
        for k, t in tensors.items():
            got = store.fetch(k, fetch_tier).result()
            assert same_bytes(got, t), k
            store.release(k)
            store.evict(k, Tier.NVME).wait()


def test_shapes_zero_elements_and_tens_of_mib(make_store):
    store = make_store(host_budget=64 << 20, device_budget=64 << 20)
    cases = {"empty": torch.empty(0, 5), "scalar": torch.tensor(3.5), "matrix": torch.randn(7, 11, 3),
             "big": torch.randn(5_000_001)}  # ~19 MiB, not a multiple of the block size
    for k, t in cases.items():
        store.put(k, t, Tier.NVME)
    for k, t in cases.items():
        got = store.fetch(k, Tier.DEVICE).result()
        assert same_bytes(got, t), k
        store.release(k)


def test_put_over_an_existing_key_replaces_it(make_store):
    store = make_store()
    store.put("k", torch.arange(10), Tier.NVME).wait()
    store.put("k", torch.ones(3, 3), Tier.NVME).wait()
    assert same_bytes(store.fetch("k", Tier.HOST).result(), torch.ones(3, 3))
    store.release("k")
    store.put("k", torch.zeros(2), Tier.HOST)
    assert same_bytes(store.fetch("k", Tier.DEVICE).result(), torch.zeros(2))
    store.release("k")
    store.evict("k").wait()
    assert same_bytes(store.fetch("k", Tier.HOST).result(), torch.zeros(2))
    store.release("k")


def test_dirty_release_is_written_back_on_eviction(make_store):
    store = make_store()
    store.put("w", torch.zeros(1000), Tier.NVME)
    w = store.fetch("w", Tier.DEVICE).result()
    w += 2
    store.release("w", dirty=True)
    store.evict("w", Tier.NVME).wait()
    assert store.stats()["writebacks"] == 1
    assert torch.equal(store.fetch("w", Tier.HOST).result(), torch.full((1000,), 2.0))
    store.release("w")
    store.evict("w").wait()
    assert store.stats()["writebacks"] == 1, "a clean copy is dropped, not written again"


def test_directory_mode_and_index_file(make_store, tmp_path):
    d = tmp_path / "fresh" / "nvme"
    store = make_store(nvme_dir=str(d), rank=3)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    t = torch.randn(5, 7).to(torch.bfloat16)
    store.put("layer3.w", t, Tier.NVME)
    store.flush()
    assert os.path.exists(d / "rank3.swap")
    index = json.loads((d / "rank3.index.json").read_text())
    e = index["keys"]["layer3.w"]
    assert (e["nbytes"], e["dtype"], e["shape"]) == (70, "bfloat16", [5, 7])
    assert e["offset"] % 4096 == 0 and len(e["checksum"]) == 8


def test_stats_count_bytes_and_io(make_store):
    store = make_store()
    store.put("a", torch.randn(10_000), Tier.NVME)
    store.fetch("a", Tier.HOST).result()
    s = store.stats()
    assert s["host"]["resident"] == 40_000 and s["nvme"]["bytes"] >= 40_000
    assert s["bytes_written"] >= 40_000 and s["bytes_read"] >= 40_000 and s["io_busy_seconds"] > 0
    assert s["fetches"] == 1 and s["misses"] == 1
    store.release("a")


def test_delete_frees_memory_and_swap_space(make_store):
    store = make_store()
    store.put("a", torch.randn(10_000), Tier.HOST)
    store.put("b", torch.randn(10_000), Tier.NVME).wait()
    store.delete("a")
    store.delete("b")
    s = store.stats()
    assert s["keys"] == 0 and s["host"]["in_use"] == 0 and s["nvme"]["bytes"] == 0
    with pytest.raises(KeyError):
        store.fetch("a")
