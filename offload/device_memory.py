"""The DEVICE tier's memory on a CUDA GPU: a byte budget over the caching allocator, and copies.

On a CPU-only machine the DEVICE tier is a second `HostBufferPool` (see store.py), so that a
HOST <-> DEVICE move hands a buffer over without copying a byte.

[Note: CUDA streams] Device buffers are allocated and filled on the store's copy stream, which the
mover thread synchronizes before handing a tensor out; `record_stream(default stream)` then keeps
the allocator from reusing the block while kernels queued on the default stream still read it.
Tensors the store returns are safe to use on the default stream; other streams must wait on it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from outcore.offload.buffer_pool import ByteBudget
from outcore.offload.buffers import Buffer, DeviceBuffer, HostBuffer
from outcore.offload.errors import OutOfBudgetError
from outcore.offload.io_config import round_up


class CudaMemory(ByteBudget):
    """Hands out `DeviceBuffer`s whose total capacity stays within `budget` bytes (nothing cached:
    the caching allocator keeps its own blocks)."""

    def __init__(self, budget: int, device: torch.device) -> None:
        super().__init__(budget, name="DEVICE")
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def try_acquire(self, nbytes: int) -> DeviceBuffer | None:
        capacity = round_up(max(nbytes, 1))
        self._check_fits(capacity)
        with self._cond:
            if not self._fits_now(capacity):
                return None
            self._charge(capacity)
        try:
            with torch.cuda.stream(self.stream):
                return DeviceBuffer(capacity, self.device)
        except torch.cuda.OutOfMemoryError as e:
            with self._cond:
                self._credit(capacity)
            raise OutOfBudgetError("DEVICE", capacity, self.budget,
                                   "The GPU itself ran out of memory below the budget; lower device_budget.") from e

    def release(self, buf: Buffer) -> None:
        with self._cond:
            self._credit(buf.capacity)

    def close(self) -> None:
        """Nothing cached here; the caching allocator keeps its own blocks."""

    def to_device(self, src: HostBuffer, dst: Buffer, nbytes: int) -> None:
        """Copy host -> device on the copy stream and wait for it; see [Note: CUDA streams]."""
        n = round_up(nbytes)
        self._on_copy_stream(lambda: dst.tensor[:n].copy_(src.tensor[:n], non_blocking=src.pinned))
        dst.tensor.record_stream(torch.cuda.default_stream(self.device))

    def to_host(self, src: Buffer, dst: HostBuffer, nbytes: int) -> None:
        """Copy device -> host after everything queued on the default stream, and wait for it."""
        n = round_up(nbytes)
        self.stream.wait_stream(torch.cuda.default_stream(self.device))
        self._on_copy_stream(lambda: dst.tensor[:n].copy_(src.tensor[:n], non_blocking=dst.pinned))

    def fill(self, dst: Buffer, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Copy a caller's tensor (any device) in, after the caller's queued work, and wait for it."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._on_copy_stream(lambda: dst.fill_from(tensor.to(self.device), dtype))
        dst.tensor.record_stream(torch.cuda.default_stream(self.device))

    def _on_copy_stream(self, copy: Callable[[], object]) -> None:
        with torch.cuda.stream(self.stream):
            copy()
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()
