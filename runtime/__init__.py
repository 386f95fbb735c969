"""outcore's ZeRO engine: units, hooks, collectives, the gradient path, the update stream,
checkpoints and the config. Its public names are re-exported by `outcore` itself; they load on
first use, so that the torch-free parts (the policy, the config's names) load without torch."""

from typing import TYPE_CHECKING

from outcore.offload.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from outcore.offload.io_config import IOConfig as IOConfig
    from outcore.runtime.config import Config as Config
    from outcore.runtime.engine import Engine as Engine
    from outcore.runtime.materialize import deferred_init as deferred_init
    from outcore.runtime.optimizer import AdamW as AdamW

_EXPORTS = {
    "Config": "outcore.runtime.config",
    "Engine": "outcore.runtime.engine",
    "deferred_init": "outcore.runtime.materialize",
    "AdamW": "outcore.runtime.optimizer",
    "IOConfig": "outcore.offload.io_config",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
