"""What a save may touch in a checkpoint directory, and who may save there.

- One writer at a time: rank 0 of the saving engine holds `.outcore-rank0.lock` (an `flock`, as
  nvme_dir's) from its first save into a directory until it saves into another one or closes. A
  second live run saving there meets one error naming the directory and the holder's pid; a dead
  run's lock dies with it. A lock whose folder another program removed (a rotation of old
  checkpoints) is let go quietly, and the next save there takes a new one.
- A save replaces only what outcore wrote: the tag's folder if it is a checkpoint (it holds a
  meta.json), and `.<tag>.old`, the previous save of a tag kept until the new one is in place,
  if it holds only rank files and meta.json. Anything else under those names is the user's:
  refused before a byte is written, and left as it is.
- Its temporary names are its own (runtime/formats/written_files.py `unique_name`). Holding the lock, a
  save also removes those of earlier saves that died, where they hold only what a save writes.
"""

from __future__ import annotations

import logging
import os
import re
import shutil

from outcore.offload.scratch_dir import DirectoryLock
from outcore.runtime.formats.written_files import nearest_existing

log = logging.getLogger(__name__)

_OUR_TEMPORARY = re.compile(r"^\..+\.\d+-[0-9a-f]{8}\.tmp$")  # written_files.unique_name's pattern


class WriterLock:
    """Rank 0's hold on the checkpoint directory it saves into (see the module docstring)."""

    def __init__(self) -> None:
        self._held: tuple[str, DirectoryLock] | None = None

    def hold(self, directory: str) -> None:
        where = os.path.realpath(directory)
        if self._held is not None and self._held[0] == where and self._held[1].still_in_place():
            return  # (a folder removed and made again needs a new lock: the old one locks nothing now)
        lock = DirectoryLock(directory, 0, what="checkpoint directory", prefix=".outcore-")
        self.release()
        self._held = (where, lock)

    def release(self) -> None:
        if self._held is not None:
            self._held[1].release(remove=True)
            self._held = None


def refuse_a_file_in_the_way(directory: str) -> None:
    """A file where the checkpoint directory, or a folder above it, should be: one clear error before
    any rank writes (otherwise the save fails on its first mkdir with a bare "File exists")."""
    path = nearest_existing(directory)
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint directory {directory!r}: {path!r} is a file; name a directory.")


def refuse_what_is_not_ours(directory: str, tag: str) -> None:
    """Refuse a save that would replace what outcore did not write (see the module docstring)."""
    final = os.path.join(directory, tag)
    if os.path.lexists(final) and not is_checkpoint_folder(final):
        raise ValueError(f"{final!r} exists and is not an outcore checkpoint (it has no meta.json): outcore replaces "
                         "only checkpoints it wrote. Save under another tag, or move it away.")
    old = os.path.join(directory, f".{tag}.old")
    if os.path.lexists(old) and not holds_only_a_save(old):
        raise ValueError(f"{old!r} holds what outcore did not write there; move it away, and save again.")


def refuse_scratch_inside(directory: str, nvme_dir: str | None) -> None:
    """The engine's nvme_dir inside the checkpoint directory would sit in, or become, a tag folder
    that a save replaces, its live swap files and lock with it: refused."""
    if nvme_dir is None:
        return
    ckpt, scratch = os.path.realpath(directory), os.path.realpath(nvme_dir)
    if scratch != ckpt and scratch.startswith(ckpt + os.sep):
        raise ValueError(f"checkpoint directory {directory!r} holds this engine's nvme_dir {nvme_dir!r}; a save "
                         "there could replace the live swap files. Save elsewhere, or move nvme_dir out of it.")


def sweep_dead_saves(directory: str) -> None:
    """With the lock held: remove the temporary folders and files of saves that died."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not _OUR_TEMPORARY.match(name):
            continue
        if os.path.isfile(path) and not os.path.islink(path) and name.startswith(".latest."):
            os.unlink(path)
        elif holds_only_a_save(path):
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed %s, left by a save that did not finish", path)


def is_checkpoint_folder(path: str) -> bool:
    return _real_dir(path) and os.path.isfile(os.path.join(path, "meta.json"))


def holds_only_a_save(folder: str) -> bool:
    """A real folder holding nothing but what a save writes into its folder."""
    return _real_dir(folder) and all(_written_by_a_save(folder, f) for f in os.listdir(folder))


def _real_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def _written_by_a_save(folder: str, name: str) -> bool:
    """A rank file or meta.json, a plain file."""
    path = os.path.join(folder, name)
    return (name == "meta.json" or (name.startswith("rank") and name.endswith(".safetensors"))) and \
        os.path.isfile(path) and not os.path.islink(path)
