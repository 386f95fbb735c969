"""outcore's own error types, the store's and its checkpoints': each names what went wrong and what to do."""

from __future__ import annotations

import os


class StorageError(RuntimeError):
    """Base of every error the tiered store raises on purpose."""


class StorageFullError(StorageError):
    """The NVMe directory cannot hold the bytes asked for."""

    def __init__(self, directory: str, bytes_needed: int, bytes_free: int | None = None) -> None:
        self.directory = directory
        self.bytes_needed = bytes_needed
        self.bytes_free = bytes_free
        free = f" ({bytes_free:,} bytes free)" if bytes_free is not None else ""
        super().__init__(
            f"NVMe directory {directory!r} is full: {bytes_needed:,} more bytes are needed{free}. "
            "Free space there or point nvme_dir at a larger disk."
        )


class StorageCorruptError(StorageError):
    """Bytes read back for a key do not match what was written (checksum or length)."""

    def __init__(self, key: str, path: str, reason: str) -> None:
        self.key = key
        self.path = path
        super().__init__(
            f"stored bytes of key {key!r} in {path!r} are corrupt: {reason}. "
            "The swap file was changed or truncated behind the store's back; restart from a checkpoint."
        )


class CheckpointCorruptError(StorageCorruptError):
    """A checkpoint file (meta.json, `latest` or a rank file) is damaged or was edited."""

    def __init__(self, path: str, reason: str) -> None:
        self.key = os.path.basename(path)
        self.path = path
        StorageError.__init__(
            self, f"checkpoint file {path!r} is corrupt: {reason}. It changed after outcore wrote it; resume from "
            "another tag (tag=..., train --tag) or re-run from an earlier checkpoint.")


class OutOfBudgetError(StorageError):
    """A tier's memory budget cannot make room for a request."""

    def __init__(self, tier: str, bytes_needed: int, budget: int, detail: str = "") -> None:
        self.tier = tier
        self.bytes_needed = bytes_needed
        self.budget = budget
        extra = f" {detail}" if detail else ""
        super().__init__(
            f"{tier} budget of {budget:,} bytes cannot hold {bytes_needed:,} more bytes.{extra} "
            f"Release keys you are done with, or raise the {tier.lower()} budget."
        )
