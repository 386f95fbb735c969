"""Where an export lands: written aside and moved into place, so a failed export leaves what was there.

A single file (`OUT.safetensors`) is written as `OUT.safetensors.tmp` and renamed over `OUT`. A
Hugging Face directory is written as `OUT.tmp`; when `OUT` already exists it may hold files of its
own (a tokenizer, a README, a run's checkpoints), so, as `save_pretrained` does, the export replaces
only the files it wrote and, when it wrote a model's weights, removes the weight shards of an
earlier export that the new one does not have. Nothing else in the directory is touched.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
"""The files of a Hugging Face directory's weights, as ShardedSafetensorsWriter names them."""

# Names a user means as one file but that would become a directory: the export writes safetensors only.
_FILE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".safetensor")


def is_one_file(out: str) -> bool:
    return out.endswith(".safetensors")


def check_export_path(out: str) -> None:
    """Refuse, before anything is read or written, an `out` the export cannot become."""
    out = os.path.normpath(out)
    if is_one_file(out):
        if os.path.isdir(out):
            raise ValueError(f"export {out!r} is a directory; name a .safetensors file to write, or the "
                             "directory without the suffix for the Hugging Face layout.")
    elif out.lower().endswith(_FILE_SUFFIXES):
        raise ValueError(f"export {out!r}: outcore writes safetensors; name a file ending in .safetensors, "
                         "or a directory for the Hugging Face layout.")
    elif os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"export {out!r} is a file; name a directory for the Hugging Face layout, or a "
                         ".safetensors file.")
    folder = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(folder):  # the folders the export makes (as save_pretrained does)
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"export {out!r} cannot be made: {folder!r} is a file, not a folder.")


@contextmanager
def export_target(out: str) -> Iterator[str]:
    """Yield the path to write the export of `out` to. On success it is moved into place; on any
    failure it is removed and `out` is as it was."""
    check_export_path(out)
    out = os.path.normpath(out)
    tmp = f"{out}.tmp"
    _remove(tmp)
    if is_one_file(out):  # a directory's own writer makes it, and its parents with it
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    try:
        yield tmp
        if is_one_file(out) or not os.path.isdir(out):
            os.replace(tmp, out)
        else:
            _merge_into(tmp, out)
    finally:
        _remove(tmp)


def _merge_into(tmp: str, out: str) -> None:
    """Move the new files into the existing directory `out`; then, if they are a model's weights,
    drop the weight files of an earlier export that they replace."""
    written = set(os.listdir(tmp))
    for name in sorted(written, key=lambda n: n.endswith(".json")):  # weights before index and config
        os.replace(os.path.join(tmp, name), os.path.join(out, name))
    if any(WEIGHT_FILE.fullmatch(n) for n in written):
        for name in os.listdir(out):
            if name not in written and WEIGHT_FILE.fullmatch(name):
                os.unlink(os.path.join(out, name))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)
