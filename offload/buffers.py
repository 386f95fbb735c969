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

    __slots__ = ("array", "_lock")

    def __init__(self, nbytes: int, *, pin: bool = False) -> None:
        self._wrap(aligned_array(nbytes), pin=pin)

    def _wrap(self, array: np.ndarray, *, pin: bool) -> None:
        self._lock = PageLock.of(array) if pin else None
        # Every view of a page-locked buffer (its tensor's, the swap file's) keeps the lock alive.
        self.array = self._lock.view if self._lock is not None else array
        Buffer.__init__(self, torch.from_numpy(self.array))  # the same memory, no copy

    @property
    def pinned(self) -> bool:
        return self._lock is not None and self._lock.address is not None

    def free(self) -> None:
        """Unpin now; the mapping itself goes when the last view of it is dropped."""
        if self._lock is not None:
            self._lock.release()


class _LockedView(np.ndarray):
    """An array over page-locked memory; its `lock` attribute is the `PageLock` it keeps alive."""


class PageLock:
    """`cudaHostRegister` over one array's memory (exact size, unlike the caching host allocator's
    powers of two), undone by `release()` or, at the latest, when the last view of that memory is
    gone. The lock holds the array, so the memory is never unmapped while registered: a mapping
    that went first would leave its address registered, and the next mapping there would fail to
    register (cudaErrorHostMemoryAlreadyRegistered) and poison the next CUDA call."""

    __slots__ = ("array", "address")

    def __init__(self, array: np.ndarray, address: int) -> None:
        self.array = array
        self.address: int | None = address

    @classmethod
    def of(cls, array: np.ndarray) -> PageLock | None:
        """The lock of `array`'s memory, or None where there is no CUDA or it refused (said)."""
        if not torch.cuda.is_available():
            return None
        address = array.ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(address, array.nbytes, 0)
        if int(err) != 0:
            _take_cuda_error()
            log.warning("cudaHostRegister of %s bytes failed (%s); this buffer stays pageable and its copies "
                        "synchronous", f"{array.nbytes:,}", err)
            return None
        return cls(array, address)

    @property
    def view(self) -> np.ndarray:
        """A new view of the memory that keeps this lock (and so the memory) alive."""
        view = self.array.view(_LockedView)
        view.lock = self  # type: ignore[attr-defined]
        return view

    def release(self) -> None:
        """Unregister now (once)."""
        if self.address is not None:
            address, self.address = self.address, None
            torch.cuda.cudart().cudaHostUnregister(address)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already; the OS unpins
            pass


def _take_cuda_error() -> None:
    """A failed runtime call leaves CUDA's last error set, and torch's next kernel-launch check would
    raise it as its own; a throwaway launch takes it (reading the last error resets it)."""
    try:
        torch.zeros(1, device="cuda")
    except Exception:  # noqa: BLE001 - this is the stale error, now cleared
        pass


class DeviceBuffer(Buffer):
    """Memory on a CUDA device (no alignment needs; the caching allocator owns it)."""

    __slots__ = ()

    def __init__(self, nbytes: int, device: torch.device) -> None:
        super().__init__(torch.empty(round_up(max(nbytes, 1)), dtype=torch.uint8, device=device))

    def free(self) -> None:
        """Nothing to do: the caching allocator reclaims it with the last reference."""
