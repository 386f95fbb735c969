"""outcore's tiered storage manager: tensors paged between DEVICE, HOST and NVMe (its API is in
the README, how it works in docs/design.md).

Names are imported on first use, so that the torch-free parts (the I/O engines, used by
`outcore bench-disk`) load without torch.
"""

import importlib

_EXPORTS = {
    "TieredStore": "outcore.offload.store",
    "Tier": "outcore.offload.residency",
    "IOConfig": "outcore.offload.io_config",
    "Handle": "outcore.offload.handle",
    "StorageError": "outcore.offload.errors",
    "StorageFullError": "outcore.offload.errors",
    "StorageCorruptError": "outcore.offload.errors",
    "OutOfBudgetError": "outcore.offload.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'outcore.offload' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
