"""Where a key's bytes live: the tiers, the residency state machine, one record per key.

[Note: residency] A key has exactly one residency state. In a stable state (NVME, HOST, DEVICE)
`buffer` holds its bytes in that tier's memory (None on NVME). In a moving state (TO_HOST,
TO_DEVICE, TO_NVME) `buffer` still holds the source bytes (None when the source is NVME) and
`move` describes the move; the destination buffer belongs to the move until it lands. The swap
file holds a valid copy whenever `dirty` is False; `dirty` is True only while memory holds bytes
newer than the swap file (or the swap file has none). Only `KeyRecord.to()` changes the state, and
only along `LEGAL`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from outcore.offload.handle import Handle

if TYPE_CHECKING:  # the tiers are torch-free, for the command line's torch-free paths
    import torch

    from outcore.offload.buffers import Buffer
    from outcore.offload.file_source import FileSource


class Tier(enum.IntEnum):
    """Storage tiers, slowest first."""

    NVME = 0
    HOST = 1
    DEVICE = 2


class Residency(enum.Enum):
    NVME = "nvme"
    HOST = "host"
    DEVICE = "device"
    TO_HOST = "to_host"  # loading from NVME, or demoting from DEVICE
    TO_DEVICE = "to_device"  # loading from NVME, or promoting from HOST
    TO_NVME = "to_nvme"  # writing back; memory is freed once the write landed


STABLE = {Tier.NVME: Residency.NVME, Tier.HOST: Residency.HOST, Tier.DEVICE: Residency.DEVICE}
MOVING = {Tier.NVME: Residency.TO_NVME, Tier.HOST: Residency.TO_HOST, Tier.DEVICE: Residency.TO_DEVICE}
TIER_OF = {v: k for k, v in STABLE.items()}

# A move starts from a stable state and ends in its destination, or, when it fails, back where it began.
LEGAL: dict[Residency, frozenset[Residency]] = {
    Residency.NVME: frozenset({Residency.TO_HOST, Residency.TO_DEVICE}),
    Residency.HOST: frozenset({Residency.TO_DEVICE, Residency.TO_NVME, Residency.NVME, Residency.DEVICE}),
    Residency.DEVICE: frozenset({Residency.TO_HOST, Residency.TO_NVME, Residency.NVME, Residency.HOST}),
    Residency.TO_HOST: frozenset({Residency.HOST, Residency.NVME, Residency.DEVICE}),
    Residency.TO_DEVICE: frozenset({Residency.DEVICE, Residency.NVME, Residency.HOST}),
    Residency.TO_NVME: frozenset({Residency.NVME, Residency.HOST, Residency.DEVICE}),
}
# HOST -> NVME and DEVICE -> NVME directly: dropping a clean copy. HOST <-> DEVICE directly: the
# zero-copy hand-over of a buffer on a CPU-only machine, where both tiers are RAM.


@dataclass(slots=True, eq=False)
class Move:
    """One move in flight; fetches of the same key to the same tier join its handle."""

    source: Residency
    target: Tier
    # the key's tensor in the target memory tier (None for a move to NVME)
    handle: Handle[Any] = field(default_factory=Handle)
    by_prefetch: bool = False


@dataclass(slots=True, eq=False)
class KeyRecord:
    """Everything the store knows of one key."""

    key: str
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    state: Residency
    buffer: Buffer | None = None
    dirty: bool = False
    pins: int = 0  # fetches not yet released; a pinned key is never evicted
    move: Move | None = None
    prefetched: bool = False  # landed by prefetch, not fetched since
    last_use: int = 0  # store clock at the last fetch or release, for LRU eviction
    home: Tier = Tier.NVME  # the tier it was put in
    # The owner's hint: after a dirty release that leaves it unpinned, send it back to `home` at
    # once rather than when the store next needs the room (optimizer states streamed through HOST).
    return_home: bool = False
    # Read from files the store does not own (offload/file_source.py [Note: read in place]), never
    # written: such a key is never dirty.
    source: FileSource | None = None

    def to(self, new: Residency) -> None:
        assert new in LEGAL[self.state], f"{self.key!r}: illegal residency change {self.state} -> {new}"
        self.state = new

    @property
    def tier(self) -> Tier | None:
        """The stable tier, or None while moving."""
        return TIER_OF.get(self.state)

    @property
    def held(self) -> Buffer:
        """The buffer holding the bytes in memory (a stable memory tier, or the source of a move)."""
        assert self.buffer is not None, f"{self.key!r} has no bytes in memory ({self.state})"
        return self.buffer

    @property
    def stable_tier(self) -> Tier:
        """The tier of a key at rest (not moving)."""
        tier = TIER_OF.get(self.state)
        assert tier is not None, f"{self.key!r} is moving ({self.state})"
        return tier

    def view(self) -> torch.Tensor:
        assert self.buffer is not None, f"{self.key!r} has no bytes in memory ({self.state})"
        return self.buffer.view(self.nbytes, self.dtype, self.shape)
