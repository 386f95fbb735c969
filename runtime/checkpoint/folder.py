"""Which checkpoint folder to read, and whether it is whole: `latest`, the tags, meta.json's checks.

Resuming takes the tag asked for, else the one `latest` names. Where `latest` is missing (a crash
after the first save's rename, before `latest` was written) or names a folder that is gone (a
crash while re-saving that tag, between its two renames), the newest complete tag is taken
instead, by step, and that is said once in the log. A re-saved tag's previous folder, kept as
`.<tag>.old` until the new one is in place, stands in for the tag.
"""

from __future__ import annotations

import json
import logging
import os
import zlib

from outcore.offload import CheckpointCorruptError
from outcore.runtime.formats.safetensors_stream import file_crc32

log = logging.getLogger(__name__)

FORMAT = 1
LATEST = "latest"


class NoCheckpointError(ValueError):
    """The directory holds no complete checkpoint: nothing to resume from yet."""


def is_tag(name: str) -> bool:
    """A plain name: no path separator, no leading dot, no whitespace or control character at all
    (`latest` holds the tag on a line of its own, and a name that changes when read back is another)."""
    return (bool(name) and "/" not in name and "\\" not in name and not name.startswith(".")
            and all(c.isprintable() and not c.isspace() for c in name))


def find_checkpoint(directory: str, tag: str | None = None) -> str:
    """The folder of `tag`, or of the newest complete checkpoint in `directory`."""
    if tag is not None:
        if not is_tag(tag):
            raise ValueError(f"checkpoint tag {tag!r}: use a plain name such as 'step100'.")
        folder = _tag_folder(directory, tag)
        if folder is None:
            raise ValueError(f"checkpoint {os.path.join(directory, tag)!r} does not exist; the tags there are "
                             f"{_tags(directory) or 'none'}.")
        return folder
    named = _read_latest(directory)
    folder = _tag_folder(directory, named) if named is not None else None
    if folder is not None:
        return folder
    newest = _newest_complete(directory)
    if newest is None:
        inner = os.path.join(directory, "checkpoints")  # where `outcore train` saves under its --out
        if _newest_complete(inner) is not None:
            raise NoCheckpointError(f"no checkpoint in {directory!r}, which looks like an `outcore train` --out: "
                                    f"its checkpoints are in {inner!r}; point there.")
        raise NoCheckpointError(f"no checkpoint in {directory!r}: no complete tag folder there; save one first, "
                                "or point at the run that did.")
    why = f"names {named!r}, which is gone" if named is not None else "is missing"
    log.warning("%s %s; taking the newest complete checkpoint, %s", os.path.join(directory, LATEST), why, newest)
    return newest


def _tag_folder(directory: str, tag: str) -> str | None:
    for name in (tag, f".{tag}.old"):  # .old: the previous save of a tag whose re-save did not finish
        folder = os.path.join(directory, name)
        if os.path.isfile(os.path.join(folder, "meta.json")):
            if name != tag:
                log.warning("checkpoint %s is missing; its previous save %s stands in for it",
                            os.path.join(directory, tag), folder)
            return folder
    return None


def _tags(directory: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(directory) if is_tag(n) and n != LATEST and
                      os.path.isfile(os.path.join(directory, n, "meta.json")))
    except OSError:
        return []


def _read_latest(directory: str) -> str | None:
    path = os.path.join(directory, LATEST)
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"cannot read {path!r}: {e.strerror}.") from e
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise CheckpointCorruptError(path, "it is not UTF-8 text") from e
    if not is_tag(name):
        raise CheckpointCorruptError(path, f"it holds {name[:60]!r}, not a bare tag name")
    return name


def _newest_complete(directory: str) -> str | None:
    best: tuple[int, float, str] | None = None
    for tag in _tags(directory):
        folder = os.path.join(directory, tag)
        try:
            meta = read_meta(folder)
        except (ValueError, CheckpointCorruptError):
            continue
        step = meta.get("step")
        key = (step if isinstance(step, int) else -1, os.path.getmtime(folder), folder)
        best = key if best is None or key > best else best
    return best[2] if best is not None else None


def digest(meta: dict) -> str:
    """crc32 of meta.json's content without its own checksum, in a canonical spelling."""
    body = {k: v for k, v in meta.items() if k != "meta_crc32"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode()):08x}"


def sealed(meta: dict) -> dict:
    """meta.json's content with its own checksum, which loading and export verify."""
    canonical = json.loads(json.dumps(meta, default=str))  # what reading it back will give
    return {**canonical, "meta_crc32": digest(canonical)}


def read_meta(folder: str) -> dict:
    """A checkpoint folder's meta.json, checked: its own checksum, the format this outcore reads, and
    a file checksum for every rank. A missing, damaged or edited one is named in the error."""
    meta_path = os.path.join(folder, "meta.json")
    try:
        with open(meta_path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"checkpoint {folder!r} has no readable meta.json ({e.strerror}).") from e
    try:
        meta = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointCorruptError(meta_path, "it is not UTF-8 text") from e
    except json.JSONDecodeError as e:
        raise CheckpointCorruptError(meta_path, f"it is not valid JSON ({e})") from e
    except RecursionError as e:  # brackets nested past what the parser follows: no meta.json of ours
        raise CheckpointCorruptError(meta_path, "it nests deeper than any meta.json outcore writes") from e
    if not isinstance(meta, dict):
        raise CheckpointCorruptError(meta_path, f"it holds a JSON {type(meta).__name__}, not an object")
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint {folder!r} has format {meta.get('format')!r}; this outcore reads format "
                         f"{FORMAT}.")
    if meta.get("meta_crc32") != digest(meta):
        raise CheckpointCorruptError(meta_path, "its checksum does not match its content (edited?)")
    world = meta.get("world_size")
    if not isinstance(world, int) or world < 1 or sorted(meta.get("files") or {}) != sorted(
            f"rank{r}.safetensors" for r in range(world)):
        raise CheckpointCorruptError(meta_path, "its list of rank files does not match its world size")
    return meta


def verify_rank_file(folder: str, meta: dict, name: str, *, checksum: bool = True) -> str:
    """The path of rank file `name`, refused by name if it is missing or its crc32 differs."""
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        raise ValueError(f"checkpoint file {path!r} is missing.")
    if checksum and f"{file_crc32(path):08x}" != meta["files"].get(name):
        raise CheckpointCorruptError(path, "its crc32 differs from the one meta.json recorded")
    return path
