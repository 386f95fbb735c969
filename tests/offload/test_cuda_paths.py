"""The CUDA paths of the store: pinned host buffers, copies on a side stream, the DEVICE budget on
a GPU, and a dirty device key written back through pinned memory. Skipped without a GPU."""

import pytest
import torch

from outcore.offload import Tier
from outcore.offload.buffers import HostBuffer
from outcore.offload.device_memory import CudaMemory

pytestmark = pytest.mark.cuda


def test_host_buffers_are_page_locked_in_place():
    buf = HostBuffer(1 << 20, pin=True)
    assert buf.pinned and buf.tensor.is_pinned()
    ptr = buf.tensor.data_ptr()
    assert ptr % 4096 == 0  # registered where it lies: the aligned mapping itself, not a copy
    buf.free()
    assert not buf.pinned


def test_copies_run_on_a_side_stream_while_the_default_stream_is_busy():
    device = torch.device("cuda", 0)
    mem = CudaMemory(64 << 20, device)
    assert mem.stream != torch.cuda.default_stream(device)
    src = HostBuffer(16 << 20, pin=True)
    src.tensor.copy_(torch.randint(0, 255, (16 << 20,), dtype=torch.uint8))
    dst = mem.try_acquire(16 << 20)
    torch.cuda._sleep(2_000_000_000)  # about a second of spinning queued on the default stream
    mem.to_device(src, dst, 16 << 20)  # returns once the copy is done, not once the stream is
    assert not torch.cuda.default_stream(device).query(), "the copy waited for the default stream"
    torch.cuda.synchronize(device)
    assert torch.equal(dst.tensor.cpu(), src.tensor)
    mem.release(dst)
    src.free()


def test_the_device_budget_bounds_what_the_store_keeps_on_the_gpu(make_store):
    store = make_store(device="cuda", device_budget=4 << 20, host_budget=8 << 20)
    values = {f"k{i}": torch.randn(256 << 10) for i in range(4)}  # 1 MiB each
    for k, v in values.items():
        store.put(k, v, Tier.NVME)
    for k, v in values.items():
        got = store.fetch(k, Tier.DEVICE).result()
        assert got.is_cuda and torch.equal(got.cpu(), v)
        store.release(k)
        assert store.stats()["device"]["in_use"] <= 4 << 20


def test_a_dirty_device_key_is_written_back_through_pinned_memory(make_store):
    store = make_store(device="cuda", device_budget=4 << 20, host_budget=4 << 20)
    store.put("w", torch.zeros(1000), Tier.NVME)
    w = store.fetch("w", Tier.DEVICE).result()
    w.add_(3.0)  # changed on the GPU, on the default stream
    store.release("w", dirty=True)
    store.evict("w", Tier.NVME).wait()
    assert store.stats()["writebacks"] == 1
    back = store.fetch("w", Tier.HOST).result()
    assert not back.is_cuda and torch.equal(back, torch.full((1000,), 3.0))
    store.release("w")


def test_stores_closed_with_keys_in_host_leave_no_memory_registered(tmp_path):
    """A closed store drops its HOST buffers without unpinning each: their memory must be unpinned
    before it is unmapped, or the next mapping at that address fails to register and poisons the
    next CUDA call (what two engines in a row hit on a GPU)."""
    from outcore.offload import TieredStore

    for i in range(4):
        store = TieredStore(nvme_dir=str(tmp_path / f"s{i}"), device="cuda", device_budget=4 << 20,
                            host_budget=8 << 20)
        for k in range(4):
            store.put(f"k{k}", torch.full((256 << 10,), float(k)), Tier.HOST)
        store.close()
    buf = HostBuffer(1 << 20, pin=True)
    assert buf.pinned
    torch.zeros(1, device="cuda")  # no stale CUDA error raised here
    buf.free()
