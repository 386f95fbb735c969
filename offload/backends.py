"""Choose an I/O engine by name."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from outcore.offload.io_config import IOConfig
from outcore.offload.io_engine import IOCounters, IOFile, IOHandle, ThreadIOEngine


class IOEngine(Protocol):
    """What the store needs of an I/O backend."""

    config: IOConfig
    counters: IOCounters

    def read(self, file: IOFile, offset: int, array: np.ndarray, *, checksum: bool = False,
             finalize=None) -> IOHandle: ...

    def write(self, file: IOFile, offset: int, array: np.ndarray, *, checksum: bool = False,
              finalize=None) -> IOHandle: ...

    def close(self) -> None: ...


def make_engine(config: IOConfig) -> IOEngine:
    """The engine `config.backend` names: "threads" (default, measured faster) or "aiofiles"."""
    if config.backend == "aiofiles":
        from outcore.offload.aio_engine import AiofilesIOEngine

        return AiofilesIOEngine(config)
    return ThreadIOEngine(config)
