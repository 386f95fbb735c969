"""outcore: offload-first, out-of-core training for PyTorch on one node.

The public API lives here; the packages under it are `outcore.offload` (the tiered store),
`outcore.runtime` (the ZeRO engine) and `outcore.tools` (the command line). Names load on first
use, so that `outcore bench-disk` and the other torch-free paths start without importing torch.
"""

import importlib

_EXPORTS = {
    "Engine": "outcore.runtime.engine",
    "Config": "outcore.runtime.config",
    "AdamW": "outcore.runtime.optimizer",
    "deferred_init": "outcore.runtime.materialize",
    "TieredStore": "outcore.offload.store",
    "Tier": "outcore.offload.residency",
    "IOConfig": "outcore.offload.io_config",
    "StorageError": "outcore.offload.errors",
    "StorageFullError": "outcore.offload.errors",
    "StorageCorruptError": "outcore.offload.errors",
    "OutOfBudgetError": "outcore.offload.errors",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'outcore' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
