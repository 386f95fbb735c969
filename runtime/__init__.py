"""outcore's ZeRO engine (SPEC.md §2)."""

from outcore.offload.io_config import IOConfig
from outcore.runtime.config import Config
from outcore.runtime.engine import Engine
from outcore.runtime.materialize import deferred_init
from outcore.runtime.optimizer import AdamW

__all__ = ["AdamW", "Config", "Engine", "IOConfig", "deferred_init"]
