"""Page-aligned memory that O_DIRECT can read into and CUDA can copy from.

A `Buffer` owns `capacity` bytes (a multiple of 4096) and hands out typed views of its first
`nbytes`. Host buffers come from anonymous mmap, so they are page-aligned, zero-filled lazily and
returned to the OS when the last view is gone (glibc's heap never holds them). Where CUDA exists
they are registered as page-locked so host-to-device copies run asynchronously.
"""

from __future__ import annotations

import logging

import torch

from offload.aligned import anonymous_map, array_over
from offload.io_config import round_up

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

    __slots__ = ("array", "pinned", "_mapping")

    def __init__(self, nbytes: int, *, pin: bool = False) -> None:
        self._mapping = anonymous_map(nbytes)
        self._bind()
        self.pinned = pin and _register_pinned(self.tensor)

    def _bind(self) -> None:
        self.array = array_over(self._mapping)
        super().__init__(torch.from_numpy(self.array))  # the same memory, no copy

    def resize(self, nbytes: int) -> bool:
        """Become `nbytes` (rounded up to a page) long, keeping the pages already in memory.

        mremap moves page tables, not bytes: the kept part costs no page fault and no zero-filling,
        which a fresh mapping pays on every page. Contents are unspecified afterwards. False, and
        nothing changed, when the buffer is pinned or a view of it is still alive elsewhere (the
        mapping cannot move under a live view; Python refuses with BufferError).
        """
        capacity = round_up(max(nbytes, 1))
        if self.pinned:
            return False
        if capacity == self.capacity:
            return True
        self.array = self.tensor = None  # our own views; any other one makes resize refuse
        try:
            self._mapping.resize(capacity)
            resized = True
        except (BufferError, OSError, SystemError, ValueError):  # a live view; or no mremap here
            resized = False
        self._bind()
        return resized

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
