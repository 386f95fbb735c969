"""outcore's tiered storage manager: tensors paged between DEVICE, HOST and NVMe (SPEC.md §1).

Names are imported on first use, so that the torch-free parts (the I/O engines, used by
`outcore bench-disk`) load without torch.
"""

import importlib

_EXPORTS = {
    "TieredStore": "offload.store",
    "Tier": "offload.residency",
    "IOConfig": "offload.io_config",
    "Handle": "offload.handle",
    "StorageError": "offload.errors",
    "StorageFullError": "offload.errors",
    "StorageCorruptError": "offload.errors",
    "OutOfBudgetError": "offload.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'offload' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
