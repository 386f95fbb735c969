"""outcore's tiered storage manager: tensors paged between DEVICE, HOST and NVMe (its API is in
the README, how it works in docs/design.md).

Names are imported on first use, so that the torch-free parts (the I/O engines, used by
`outcore bench-disk`) load without torch.
"""

from typing import TYPE_CHECKING

from outcore.offload.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from outcore.offload.errors import CheckpointCorruptError as CheckpointCorruptError
    from outcore.offload.errors import OutOfBudgetError as OutOfBudgetError
    from outcore.offload.errors import StorageCorruptError as StorageCorruptError
    from outcore.offload.errors import StorageError as StorageError
    from outcore.offload.errors import StorageFullError as StorageFullError
    from outcore.offload.handle import Handle as Handle
    from outcore.offload.io_config import IOConfig as IOConfig
    from outcore.offload.residency import Tier as Tier
    from outcore.offload.store import TieredStore as TieredStore

_EXPORTS = {
    "TieredStore": "outcore.offload.store",
    "Tier": "outcore.offload.residency",
    "IOConfig": "outcore.offload.io_config",
    "Handle": "outcore.offload.handle",
    "StorageError": "outcore.offload.errors",
    "StorageFullError": "outcore.offload.errors",
    "StorageCorruptError": "outcore.offload.errors",
    "CheckpointCorruptError": "outcore.offload.errors",
    "OutOfBudgetError": "outcore.offload.errors",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
