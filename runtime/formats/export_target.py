"""Where an export lands: written aside and moved into place, so a failed export leaves what was there.

A single file (`OUT.safetensors`) is written under a name beside it that is this writer's alone and
renamed over `OUT`. A Hugging Face directory is written the same way, as a folder. When `OUT`
already exists it may hold files of its own (a tokenizer, a README, a run's checkpoints), so, as
`save_pretrained` does, the export replaces only the files it wrote and, when it wrote a model's
weights, drops the weight shards of an earlier export that the new one does not have. It does so
whole: the rest of `OUT` is hard-linked into the new folder, and the two folders are swapped in one
atomic exchange. A kill at any instant leaves `OUT` all old or all new, never new shards beside an
old index.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from outcore.offload import StorageError
from outcore.runtime.formats.written_files import link_tree, nearest_existing, replace_whole, unique_name

WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
"""The files of a Hugging Face directory's weights, as ShardedSafetensorsWriter names them."""

log = logging.getLogger(__name__)

# Names a user means as one file but that would become a directory: the export writes safetensors only.
_FILE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".safetensor")


def is_one_file(out: str) -> bool:
    return out.endswith(".safetensors")


def check_export_path(out: str, protected: Iterable[str] = ()) -> None:
    """Refuse, before anything is read or written, an `out` the export cannot become, or one that
    would replace or sit among `protected` files (the weights a run reads or its checkpoints refer
    to, runtime/checkpoint/base_files.py): an export into a base's directory would replace its weights."""
    out = os.path.normpath(out)
    where = os.path.realpath(out)
    for path in protected:
        if where in (os.path.realpath(path), os.path.realpath(os.path.dirname(path))):
            raise ValueError(f"export {out!r} would write where {path!r} lies, which this run's weights are read "
                             "from or its checkpoints refer to; export into another directory.")
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
    folder = nearest_existing(os.path.dirname(os.path.abspath(out)))  # the export makes the rest, as save_pretrained
    if not os.path.isdir(folder):
        raise ValueError(f"export {out!r} cannot be made: {folder!r} is a file, not a folder.")


@contextmanager
def export_target(out: str) -> Iterator[str]:
    """Yield the path to write the export of `out` to: a name beside `out` that is this writer's
    alone (`written_files.unique_name`), a folder made here for the Hugging Face layout, a file the
    writer creates for one file. On success it is moved into place whole; on any failure it is
    removed and `out` is as it was."""
    check_export_path(out)
    out = os.path.normpath(out)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)  # as save_pretrained does
    tmp = unique_name(out)
    one_file = is_one_file(out)
    if not one_file:
        os.mkdir(tmp)  # exclusively: the name is new, and nobody else's
    try:
        try:
            yield tmp
        except OSError as e:
            todo = ("free space there, or export elsewhere" if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
                    else "mend that, or export elsewhere")
            raise StorageError(f"export {out!r}: writing {e.filename or tmp!r} failed: {e.strerror}. What was "
                               f"written is removed and {out!r} is as it was; {todo}.") from e
        if one_file:
            if os.path.lexists(out):
                log.warning("export %s: replaced the file that was there", out)
            os.replace(tmp, out)  # over a link, the link itself is replaced: nothing is followed
        elif not os.path.lexists(out):
            os.rename(tmp, out)
        else:
            _carry_over(out, tmp)
            replace_whole(tmp, out)  # `out` is then either all old or all new, never a mix
    finally:
        _remove(tmp)  # on success, what was `out` before (a directory swapped out) or nothing


def _carry_over(out: str, tmp: str) -> None:
    """Into the new folder, what of `out` the export does not replace, hard-linked (no bytes
    copied, and the files stay the user's same files): everything but the files it wrote and, when
    it wrote a model's weights, the weight files of an earlier export that the new ones replace."""
    written = set(os.listdir(tmp))
    drop_weights = any(WEIGHT_FILE.fullmatch(n) for n in written)
    replaced = []
    for name in os.listdir(out):
        if name in written or (drop_weights and WEIGHT_FILE.fullmatch(name)):
            replaced.append(name)
            continue
        try:
            link_tree(os.path.join(out, name), os.path.join(tmp, name))
        except OSError as e:
            raise OSError(e.errno, f"export {out!r} replaces that folder whole, and cannot carry "
                          f"{os.path.join(out, name)!r} over into the new one ({e.strerror}); export into a new "
                          "directory, or move that away", e.filename) from e
    if replaced:
        shown = ", ".join(sorted(replaced)[:4]) + (f" and {len(replaced) - 4} more" if len(replaced) > 4 else "")
        log.warning("export %s: replaced what the folder held under the names it writes: %s", out, shown)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)
