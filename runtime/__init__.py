"""outcore's ZeRO engine (SPEC.md §2). Not built yet: only the shared I/O settings live here so far."""

from offload.io_config import IOConfig

__all__ = ["IOConfig"]
