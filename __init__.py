"""outcore: offload-first, out-of-core training for PyTorch on one node.

The public API lives here; the packages under it are `outcore.offload` (the tiered store),
`outcore.runtime` (the ZeRO engine), `outcore.hf` (Hugging Face models, data and the Trainer) and
`outcore.tools` (the command line). Names load on first use, so that `outcore bench-disk` and the
other torch-free paths start without importing torch.
"""

from typing import TYPE_CHECKING, Any

from outcore.offload.lazy_exports import lazy_exports
from outcore.runtime.model_family import register_family

if TYPE_CHECKING:
    from outcore import hf as hf
    from outcore.offload.errors import CheckpointCorruptError as CheckpointCorruptError
    from outcore.offload.errors import OutOfBudgetError as OutOfBudgetError
    from outcore.offload.errors import StorageCorruptError as StorageCorruptError
    from outcore.offload.errors import StorageError as StorageError
    from outcore.offload.errors import StorageFullError as StorageFullError
    from outcore.offload.io_config import IOConfig as IOConfig
    from outcore.offload.residency import Tier as Tier
    from outcore.offload.store import TieredStore as TieredStore
    from outcore.runtime.collectives import RanksLostError as RanksLostError
    from outcore.runtime.config import Config as Config
    from outcore.runtime.engine import Engine as Engine
    from outcore.runtime.materialize import deferred_init as deferred_init
    from outcore.runtime.optimizer import AdamW as AdamW
    from outcore.runtime.released import ReleasedParameterError as ReleasedParameterError

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
    "CheckpointCorruptError": "outcore.offload.errors",
    "OutOfBudgetError": "outcore.offload.errors",
    "RanksLostError": "outcore.runtime.collectives",
    "ReleasedParameterError": "outcore.runtime.released",
    "hf": "outcore.hf",  # the Hugging Face wing, loaded on first use (it imports transformers)
}



def _hugging_face_family(model: Any) -> Any:
    """The engine knows Hugging Face models through `outcore.hf` (runtime/model_family.py), loaded
    when an engine first asks about a model."""
    from outcore.hf.model_family import hugging_face_family

    return hugging_face_family(model)


register_family(_hugging_face_family)

__all__ = sorted(k for k in _EXPORTS if k != "hf")  # `import *` loads no transformers
__version__ = "0.1.0"
__getattr__ = lazy_exports(__name__, _EXPORTS)
