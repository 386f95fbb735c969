"""Page-locked host buffers without a GPU: a stand-in for CUDA's runtime records what is registered,
so the lifetime rules are checked here; tests/offload/test_cuda_paths.py checks them on a GPU."""

import gc
import logging
import weakref

import pytest
import torch

from outcore.offload import buffers
from outcore.offload.buffers import HostBuffer


class FakeCudart:
    """Registrations by address; `unregister` checks the memory is still mapped at that moment."""

    def __init__(self, fail_with: int = 0) -> None:
        self.fail_with = fail_with
        self.mapping_of: dict[int, weakref.ref] = {}  # address -> the mmap under it
        self.registered: dict[int, weakref.ref] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address, nbytes, flags):  # noqa: N802 - CUDA's name
        if self.fail_with:
            return self.fail_with
        assert address not in self.registered, "registered twice: cudaErrorHostMemoryAlreadyRegistered"
        self.registered[address] = self.mapping_of[address]
        return 0

    def cudaHostUnregister(self, address):  # noqa: N802 - CUDA's name
        mapping = self.registered.pop(address)
        assert mapping() is not None and not mapping().closed, "unregistered after the memory was unmapped"
        self.unregistered.append(address)
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    real_aligned = buffers.aligned_array

    def aligned(nbytes):  # remember each array's mmap, to see when it is unmapped
        arr = real_aligned(nbytes)
        fake.mapping_of[arr.ctypes.data] = weakref.ref(arr.base.obj if hasattr(arr.base, "obj") else arr.base)
        return arr

    monkeypatch.setattr(buffers, "aligned_array", aligned)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_free_unpins_once(cudart):
    buf = HostBuffer(1 << 20, pin=True)
    assert buf.pinned and len(cudart.registered) == 1
    buf.free()
    buf.free()
    assert not buf.pinned and len(cudart.unregistered) == 1
    del buf
    gc.collect()
    assert len(cudart.unregistered) == 1


def test_a_buffer_dropped_without_free_unpins_when_its_last_view_goes_and_before_its_memory_does(cudart):
    buf = HostBuffer(1 << 20, pin=True)
    address = buf.tensor.data_ptr()
    views = [buf.tensor[4096:].view(torch.float32), buf.array[:8192]]  # a tensor's and the swap file's
    del buf
    gc.collect()
    assert cudart.unregistered == [], "unpinned while views of the memory were alive"
    views.pop()
    gc.collect()
    assert cudart.unregistered == []
    views.pop()
    assert cudart.unregistered == [address]  # on the last view's release, no collector needed


def test_memory_reused_after_a_dropped_buffer_registers_again(cudart):
    for _ in range(20):
        buf = HostBuffer(1 << 20, pin=True)  # the same size: the kernel may hand back the same address
        assert buf.pinned
        del buf
    assert len(cudart.unregistered) == 20 and not cudart.registered


def test_a_refused_registration_leaves_the_buffer_pageable_and_says_so(cudart, monkeypatch, caplog):
    cudart.fail_with = 712
    taken = []
    monkeypatch.setattr(buffers, "_take_cuda_error", lambda: taken.append(True))
    with caplog.at_level(logging.WARNING, logger="outcore"):
        buf = HostBuffer(1 << 20, pin=True)
    assert not buf.pinned and taken == [True]
    assert "cudaHostRegister" in caplog.text and "712" in caplog.text
    buf.tensor.fill_(1)
    buf.free()
    assert cudart.unregistered == []
