"""Choose an I/O engine by name."""

from __future__ import annotations

from outcore.offload.io_config import IOConfig
from outcore.offload.io_engine import IOEngine, ThreadIOEngine

__all__ = ["IOEngine", "make_engine"]


def make_engine(config: IOConfig) -> IOEngine:
    """The engine `config.backend` names: "threads" (default, measured faster) or "aiofiles"."""
    if config.backend == "aiofiles":
        from outcore.offload.aio_engine import AiofilesIOEngine

        return AiofilesIOEngine(config)
    return ThreadIOEngine(config)
