"""What a run's data files held when it started: each file's size and CRC-32C, recorded in OUT/run.json
so that a resume on data whose bytes changed since is refused, naming the file (a path alone says
nothing of what is in it)."""

from __future__ import annotations

import os

import crc32c

_CHUNK = 8 << 20
_seen: dict[tuple, dict[str, int]] = {}  # by what stat says of the files: a resume checks, then records


def fingerprint(path: str) -> dict[str, int]:
    """{"bytes", "crc32c"} of a file, or of a directory's files (a `save_to_disk` folder) in name order;
    read once per process while stat says the files are unchanged (a resume checks, then records)."""
    files = _files(path)
    stamp = tuple((name, *_stat(name)) for name in files)
    if stamp not in _seen:
        _seen[stamp] = _read(files)
    return _seen[stamp]


def _stat(name: str) -> tuple[int, int, int]:
    st = os.stat(name)
    return st.st_ino, st.st_size, st.st_mtime_ns


def _files(path: str) -> list[str]:
    files = [path]
    if os.path.isdir(path):
        files = sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names)
    return files


def _read(files: list[str]) -> dict[str, int]:
    size, crc = 0, 0
    for name in files:
        with open(name, "rb") as f:
            while chunk := f.read(_CHUNK):
                crc = crc32c.crc32c(chunk, crc)
                size += len(chunk)
    return {"bytes": size, "crc32c": crc}


def fingerprints(paths: list[str]) -> dict[str, dict[str, int]]:
    """Each readable path's fingerprint, by path (one that cannot be read now is left to the run to name)."""
    out = {}
    for path in paths:
        try:
            out[path] = fingerprint(path)
        except OSError:
            continue
    return out


def changed(recorded: dict[str, dict[str, int]], paths: list[str]) -> list[str]:
    """One line for each of `paths` whose bytes differ from what `recorded` says it held."""
    lines = []
    for path in paths:
        before = recorded.get(path)
        if before is None:
            continue
        try:
            now = fingerprint(path)
        except OSError as e:
            lines.append(f"{path} cannot be read now ({e.strerror})")
            continue
        if now != before:
            lines.append(f"{path} changed since the run started ({before['bytes']:,} bytes then, {now['bytes']:,} "
                         "now" + (", the same size but other bytes" if now["bytes"] == before["bytes"] else "") + ")")
    return lines
