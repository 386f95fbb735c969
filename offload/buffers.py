"""Page-aligned memory that O_DIRECT can read into and CUDA can copy from.

A `Buffer` owns `capacity` bytes (a multiple of 4096) and hands out typed views of its first
`nbytes`. Host buffers come from anonymous mmap, so they are page-aligned, zero-filled lazily and
returned to the OS when the last view is gone (glibc's heap never holds them); the store's pageable
ones are cut from one such mapping (offload/host_arena.py). Where CUDA exists they are registered as
page-locked so host-to-device copies run asynchronously.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from outcore.offload.aligned import aligned_array
from outcore.offload.io_config import round_up

log = logging.getLogger(__name__)


class Buffer:
    """`capacity` bytes of memory on one device, viewed as uint8 in `.tensor`."""

    __slots__ = ("capacity", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        assert tensor.dtype == torch.uint8 and tensor.dim() == 1
        self.capacity = tensor.numel()
        self.tensor = tensor

    def view(self, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The first `nbytes` as a tensor of `dtype` and `shape` (no copy)."""
        assert nbytes <= self.capacity
        return self.tensor[:nbytes].view(dtype).view(shape)

    def fill_from(self, src: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Copy `src` in, converted to `dtype` on the way (one pass)."""
        dtype = dtype or src.dtype
        self.tensor[: src.numel() * dtype.itemsize].view(dtype).copy_(src.detach().reshape(-1))


class HostBuffer(Buffer):
    """Page-aligned CPU memory from anonymous mmap; page-locked when `pin` is set."""

    __slots__ = ("array", "pinned")

    def __init__(self, nbytes: int, *, pin: bool = False) -> None:
        self._wrap(aligned_array(nbytes), pin=pin)

    def _wrap(self, array: np.ndarray, *, pin: bool) -> None:
        self.array = array
        Buffer.__init__(self, torch.from_numpy(array))  # the same memory, no copy
        self.pinned = pin and _register_pinned(self.tensor)

    def free(self) -> None:
        """Unpin; the mapping itself goes when the last view of it is dropped."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False


def _register_pinned(t: torch.Tensor) -> bool:
    """Page-lock `t` in place (exact size, unlike the caching host allocator's powers of two)."""
    if not torch.cuda.is_available():
        return False
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(err) != 0:
        log.warning("cudaHostRegister failed (%s); host buffers stay pageable and copies synchronous", err)
        return False
    return True


class DeviceBuffer(Buffer):
    """Memory on a CUDA device (no alignment needs; the caching allocator owns it)."""

    __slots__ = ()

    def __init__(self, nbytes: int, device: torch.device) -> None:
        super().__init__(torch.empty(round_up(max(nbytes, 1)), dtype=torch.uint8, device=device))

    def free(self) -> None:
        """Nothing to do: the caching allocator reclaims it with the last reference."""
