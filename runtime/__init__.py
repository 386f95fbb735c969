"""outcore's ZeRO engine (SPEC.md §2)."""

from offload.io_config import IOConfig
from runtime.config import Config
from runtime.engine import Engine
from runtime.materialize import deferred_init
from runtime.optimizer import AdamW

__all__ = ["AdamW", "Config", "Engine", "IOConfig", "deferred_init"]
