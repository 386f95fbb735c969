"""Conformance: every memory tier (HOST, DEVICE on a CPU, DEVICE on a GPU) keeps its budget,
hands out buffers that hold what is written into them, and gets its room back on release."""

import pytest
import torch

from outcore.offload.buffer_pool import HostBufferPool, PinnedBufferPool
from outcore.offload.device_memory import CudaMemory
from outcore.offload.errors import OutOfBudgetError
from outcore.offload.io_config import PAGE

BUDGET = 8 * PAGE


class MemoryTierConformance:
    """Run against each tier's memory by the subclasses below; `make(budget)` builds one."""

    device = "cpu"

    def make(self, budget: int):
        raise AssertionError("a subclass names the tier")

    def test_buffers_are_whole_pages_within_the_budget(self):
        mem = self.make(BUDGET)
        a = mem.try_acquire(1)
        b = mem.try_acquire(PAGE + 1)
        assert a.capacity == PAGE and b.capacity == 2 * PAGE
        assert mem.in_use == 3 * PAGE <= mem.budget
        assert mem.available() == BUDGET - 3 * PAGE
        mem.release(a)
        mem.release(b)
        mem.close()

    def test_the_budget_is_never_exceeded(self):
        mem = self.make(BUDGET)
        held = [mem.try_acquire(2 * PAGE) for _ in range(4)]
        assert all(h is not None for h in held)
        assert mem.try_acquire(1) is None  # full: no room, no error
        assert mem.in_use == BUDGET and mem.peak == BUDGET
        mem.release(held.pop())
        assert mem.try_acquire(2 * PAGE) is not None  # the released room comes back
        mem.close()

    def test_a_key_larger_than_the_whole_budget_is_refused_at_once(self):
        mem = self.make(BUDGET)
        with pytest.raises(OutOfBudgetError, match="budget"):
            mem.try_acquire(BUDGET + 1)
        mem.close()

    def test_a_buffer_holds_the_bytes_written_into_it(self):
        mem = self.make(BUDGET)
        buf = mem.try_acquire(3 * 1000 * 4)
        src = torch.randn(3, 1000, dtype=torch.float32)
        buf.fill_from(src.to(self.device))
        got = buf.view(src.numel() * 4, torch.float32, (3, 1000))
        assert got.device.type == self.device and torch.equal(got.cpu(), src)
        converted = mem.try_acquire(src.numel() * 2)
        converted.fill_from(src.to(self.device), torch.bfloat16)  # converted on the way in
        assert torch.equal(converted.view(src.numel() * 2, torch.bfloat16, (3, 1000)).cpu(), src.bfloat16())
        mem.release(buf)
        mem.release(converted)
        mem.close()


class TestHostTier(MemoryTierConformance):
    def make(self, budget):
        return HostBufferPool(budget, name="HOST")


class TestHostTierOfAGpu(MemoryTierConformance):
    """A GPU's HOST tier (page-locked where CUDA exists; its caching runs without CUDA too)."""

    def make(self, budget):
        return PinnedBufferPool(budget)


class TestDeviceTierOnACpu(MemoryTierConformance):
    """On a CPU-only machine DEVICE is budgeted RAM: a second pool of host buffers."""

    def make(self, budget):
        return HostBufferPool(budget, name="DEVICE")


@pytest.mark.cuda
class TestDeviceTierOnAGpu(MemoryTierConformance):
    device = "cuda"

    def make(self, budget):
        return CudaMemory(budget, torch.device("cuda", 0))
