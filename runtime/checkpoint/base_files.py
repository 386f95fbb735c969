"""The weights files a run started from (`weights=`): what a checkpoint records of them, and what a
resume or an export checks against that record.

A checkpoint records the base as `weights_source`: its directory and, by file name, each file's
size and checksum, as computed from the bytes at the run's start. A resume whose engine was built
from other weights is then refused, naming both directories, where the bytes differ: the frozen
parameters in the checkpoint (or read from the recorded files) would otherwise silently stand in
for the ones the user named. Where the bytes match but the directory moved, the resume reads the
frozen units the checkpoint refers to from the new place. An export never writes where these
files lie (runtime/formats/export_target.py `protected`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from outcore.offload.file_source import FileStamp
from outcore.runtime.frozen_in_place import reference_checksum, remember_checksums


@dataclass(frozen=True)
class BaseFiles:
    """The files of `weights=`, by absolute path, with their stamps at the start."""

    directory: str
    stamps: dict[str, FileStamp]

    def remember(self) -> None:
        """Checksum the files now: the reference the run's saves are held to (rank 0 saves)."""
        remember_checksums(self.stamps)

    def record(self) -> dict:
        """meta.json's `weights_source`."""
        return {"dir": self.directory, "files": {os.path.basename(p): {"size": s.size,
                                                                        "checksum": reference_checksum(p, s)}
                                                 for p, s in sorted(self.stamps.items())}}

    def moved_from(self, recorded: dict, where: str) -> dict[str, str]:
        """The checkpoint's base files (`recorded`: meta.json's `weights_source`) mapped to these, by
        name, once every one is found to hold the same bytes; ValueError naming both directories
        otherwise. An empty mapping where the directory is the same."""
        ours = self.record()
        if ours["files"] != recorded["files"]:
            theirs, mine = recorded["files"], ours["files"]
            differing = sorted(n for n in set(theirs) | set(mine) if theirs.get(n) != mine.get(n))
            if os.path.realpath(recorded["dir"]) == os.path.realpath(self.directory):
                raise ValueError(f"{where} was trained from the weights in {recorded['dir']!r}, whose "
                                 f"{differing[0]!r} no longer holds what it held when the checkpoint was written "
                                 "(size or checksum differ): put the original weights back there.")
            raise ValueError(f"{where} was trained from the weights in {recorded['dir']!r}, and this engine was "
                             f"built from {self.directory!r}, whose {differing[0]!r} holds other bytes (or is "
                             f"missing on one side): resuming would train on another base than the one named. Name "
                             f"{recorded['dir']!r} (or a copy of it) as the model, or start a new run.")
        if os.path.realpath(recorded["dir"]) == os.path.realpath(self.directory):
            return {}
        return {os.path.join(recorded["dir"], name): os.path.join(self.directory, name) for name in ours["files"]}


def base_files(path: str, stamps: dict[str, FileStamp]) -> BaseFiles:
    """The BaseFiles of weights `path` (a directory, or one file) whose files were stamped `stamps`."""
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    return BaseFiles(os.path.abspath(directory), dict(stamps))


def protected_paths(meta: dict) -> list[str]:
    """The files a checkpoint depends on or came from (its weights files and the run's base), which
    no export may replace."""
    source = meta.get("weights_source") or {}
    return sorted({*(meta.get("weights_files") or {}),
                   *(os.path.join(source["dir"], name) for name in source.get("files", {}))})
