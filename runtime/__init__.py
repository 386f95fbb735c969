"""outcore's ZeRO engine (SPEC.md §2)."""

from offload.io_config import IOConfig
from runtime.config import Config

__all__ = ["Config", "IOConfig"]
