"""I/O settings shared by the store, the engine's config and `outcore bench-disk`."""

from __future__ import annotations

from dataclasses import dataclass

from outcore.offload.typed_fields import check_fields

PAGE = 4096  # alignment of buffers, file offsets and lengths for O_DIRECT

BACKENDS = ("threads", "aiofiles")


@dataclass(frozen=True, slots=True)
class IOConfig:
    """How the store talks to its NVMe files.

    block_size:  bytes per request; a multiple of 4096.
    queue_depth: requests in flight at once (queued plus running) per engine.
    threads:     worker threads issuing requests; the disk sees at most min(threads, queue_depth).
    direct:      O_DIRECT where the filesystem allows it (falls back to buffered, logged once).
    backend:     "threads" (os.preadv/pwritev in a thread pool) or "aiofiles" (asyncio).
    checksum:    CRC-32C (offload/checksum.py) of every block on write, verified on read.
    nice:        how much lower than compute the store's and optimizer's threads run (Linux nice
                 increment, 0 = the same); see offload/background.py.
    """

    block_size: int = 1 << 20
    queue_depth: int = 32
    threads: int = 4
    direct: bool = True
    backend: str = "threads"
    checksum: bool = True
    nice: int = 15

    def __post_init__(self) -> None:
        check_fields(self, "io.")
        if self.block_size < PAGE or self.block_size % PAGE:
            raise ValueError(f"io.block_size={self.block_size} must be a positive multiple of {PAGE}.")
        if self.queue_depth < 1:
            raise ValueError(f"io.queue_depth={self.queue_depth} must be at least 1.")
        if self.threads < 1:
            raise ValueError(f"io.threads={self.threads} must be at least 1.")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"io.nice={self.nice} must lie in 0..19 (0: background threads at compute's priority).")
        if self.backend not in BACKENDS:
            raise ValueError(f"io.backend={self.backend!r} is not one of {', '.join(BACKENDS)}.")


def round_up(n: int, multiple: int = PAGE) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple
