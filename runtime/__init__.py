"""outcore's ZeRO engine: units, hooks, collectives, the gradient path, the update stream,
checkpoints and the config. Its public names are re-exported by `outcore` itself; they load on
first use, so that the torch-free parts (the policy, the config's names) load without torch."""

import importlib

_EXPORTS = {
    "Config": "outcore.runtime.config",
    "Engine": "outcore.runtime.engine",
    "deferred_init": "outcore.runtime.materialize",
    "AdamW": "outcore.runtime.optimizer",
    "IOConfig": "outcore.offload.io_config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'outcore.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
