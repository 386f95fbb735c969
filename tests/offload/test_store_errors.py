import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from outcore.offload import OutOfBudgetError, StorageCorruptError, StorageError, Tier


def _offset_of(store, key):
    store.flush()
    return json.loads(open(store.state.swap.index_path).read())["keys"][key]["offset"]


def test_corrupt_swap_bytes_raise_naming_the_key(make_store):
    store = make_store()
    store.put("good", torch.randn(3000), Tier.NVME)
    store.put("layer7.w", torch.randn(3000), Tier.NVME)
    off = _offset_of(store, "layer7.w")
    with open(store.state.swap.path, "r+b") as f:
        f.seek(off + 100)
        f.write(b"\xff\x00\xff")
    with pytest.raises(StorageCorruptError, match="layer7.w.*checksum mismatch"):
        store.fetch("layer7.w", Tier.HOST).result()
    assert store.fetch("good", Tier.HOST).result().shape == (3000,), "other keys stay readable"
    store.release("good")
    store.release("layer7.w")


def test_a_fetch_now_that_fails_holds_no_pin(make_store):
    store = make_store()
    store.put("layer7.w", torch.randn(3000), Tier.NVME)
    off = _offset_of(store, "layer7.w")
    with open(store.state.swap.path, "r+b") as f:
        f.seek(off + 100)
        f.write(b"\xff\x00\xff")
    for _ in range(2):  # the second meets the same error, not a key still in use
        with pytest.raises(StorageCorruptError, match="layer7.w.*checksum mismatch"):
            store.fetch_now("layer7.w", Tier.HOST)
    with pytest.raises(ValueError, match="without a matching fetch"):
        store.release("layer7.w")
    store.delete("layer7.w")  # not pinned: it can go
    assert "layer7.w" not in store


def test_truncated_swap_file_raises_naming_the_key(make_store):
    store = make_store()
    store.put("a", torch.randn(3000), Tier.NVME)
    store.put("tail", torch.randn(3000), Tier.NVME)
    os.truncate(store.state.swap.path, _offset_of(store, "tail") + 4096)
    with pytest.raises(StorageCorruptError, match="tail.*truncated"):
        store.fetch("tail", Tier.DEVICE).result()
    store.release("tail")


FULL_DISK = textwrap.dedent("""
    import resource, signal, sys, torch
    from outcore.offload import TieredStore, Tier, IOConfig, StorageFullError
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG back instead of dying
    resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, 8 << 20))  # the disk holds 8 MiB
    store = TieredStore(sys.argv[1], "cpu", 8 << 20, 8 << 20, IOConfig(block_size=1 << 16), wait_timeout=5)
    kept = {}
    try:
        for i in range(100):
            t = torch.full((1 << 18,), float(i))  # 1 MiB each
            store.put(f"k{i}", t, Tier.NVME).wait()
            kept[f"k{i}"] = t
        print("never full"); sys.exit(3)
    except StorageFullError as e:
        assert sys.argv[1] in str(e) and "bytes are needed" in str(e), e
        print("full after", len(kept), "keys:", e)
    try:
        store.put("k0", torch.zeros(1 << 20), Tier.NVME).wait()
        sys.exit(4)
    except StorageFullError:
        pass
    for k, t in kept.items():  # nothing already written is lost, k0 included
        assert torch.equal(store.fetch(k, Tier.HOST).result(), t), k
        store.release(k)
    assert f"k{len(kept)}" not in store.keys()
    store.close()
    print("ok")
""")


@pytest.mark.slow
def test_full_disk_raises_and_loses_nothing(tmp_path):
    res = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path / "nvme")], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "full after" in res.stdout and res.stdout.strip().endswith("ok")
    assert int(res.stdout.split("full after ")[1].split()[0]) >= 4


def test_nvme_dir_that_is_a_file_is_refused(make_store, tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(StorageError, match="not a directory"):
        make_store(nvme_dir=str(f))


def test_pinned_keys_exhaust_the_budget(make_store):
    store = make_store(host_budget=64 << 10, wait_timeout=0.3)
    for k in "ab":
        store.put(k, torch.zeros(10_000), Tier.NVME)  # 40 KB each: one fits
    store.fetch("a", Tier.HOST).result()
    with pytest.raises(OutOfBudgetError, match="HOST budget"):
        store.fetch("b", Tier.HOST).result()
    store.release("b")
    store.release("a")
    assert store.fetch("b", Tier.HOST).result().shape == (10_000,), "room appears once released"
    store.release("b")
    with pytest.raises(OutOfBudgetError, match="larger than the whole budget"):
        store.put("huge", torch.zeros(100_000), Tier.HOST)
    assert "huge" not in store.keys()


def test_misuse_gets_clear_errors(make_store):
    store = make_store()
    store.put("k", torch.ones(4), Tier.HOST)
    with pytest.raises(KeyError, match="put\\(\\) it first"):
        store.fetch("nope")
    with pytest.raises(ValueError, match="without a matching fetch"):
        store.release("k")
    with pytest.raises(ValueError, match="Tier.HOST or Tier.DEVICE"):
        store.fetch("k", Tier.NVME)
    store.fetch("k", Tier.HOST).result()
    with pytest.raises(ValueError, match="in use"):
        store.evict("k")
    with pytest.raises(ValueError, match="release it before fetching it to DEVICE"):
        store.fetch("k", Tier.DEVICE)
    store.release("k")
    with pytest.raises(ValueError, match="meta device has no bytes"):
        store.put("m", torch.ones(4, device="meta"), Tier.NVME)
    assert "m" not in store


def test_a_failed_put_keeps_the_old_value(make_store):
    store = make_store(host_budget=64 << 10)
    store.put("k", torch.ones(100), Tier.NVME).wait()
    with pytest.raises(OutOfBudgetError):
        store.put("k", torch.zeros(100_000), Tier.NVME)  # its staging copy cannot fit
    assert torch.equal(store.fetch("k", Tier.HOST).result(), torch.ones(100))
    store.release("k")
