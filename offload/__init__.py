"""outcore's tiered storage manager: tensors paged between DEVICE, HOST and NVMe (SPEC.md §1)."""

from offload.errors import OutOfBudgetError, StorageCorruptError, StorageError, StorageFullError
from offload.handle import Handle
from offload.io_config import IOConfig
from offload.residency import Tier
from offload.store import TieredStore

__all__ = ["Handle", "IOConfig", "OutOfBudgetError", "StorageCorruptError", "StorageError", "StorageFullError",
           "Tier", "TieredStore"]
