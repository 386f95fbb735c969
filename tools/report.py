"""Output shared by the commands: a plain table for people, JSON for machines, a quiet progress bar."""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from contextlib import contextmanager

from outcore.runtime.formats.written_files import create_file, unique_name


def table(headers: list[str], rows: list[list], *, out=None) -> None:
    """Print rows under headers, columns right-aligned to their widest cell."""
    out = out or sys.stdout
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)), file=out)
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)), file=out)


def peak_rss() -> int:
    """This process's own peak resident set size in bytes: Linux's VmHWM. `getrusage`'s ru_maxrss
    is only the fallback, for a child process inherits its parent's at fork: one started by a large
    parent (a test run, a benchmark that has just built a model) would report the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def check_writable(path: str, flag: str, *, folder: bool = False) -> None:
    """Before any work: `path` can be written (a folder made, or a file created, where it says);
    else a ValueError naming `flag`."""
    path = os.path.abspath(path)
    if not folder and os.path.islink(path):
        raise ValueError(f"{flag} {path!r} is a symbolic link; outcore writes no file through a link: name the "
                         "file itself.")
    if not folder and os.path.exists(path) and not os.path.isdir(path) and not os.path.isfile(path):
        raise ValueError(f"{flag} {path!r} is not a regular file (a FIFO, a device or a socket); name a file.")
    if os.path.exists(path) and os.path.isdir(path) != folder:
        raise ValueError(f"{flag} {path!r} is a {'file' if folder else 'directory'}; name a "
                         f"{'directory' if folder else 'file'}.")
    probe = path if folder else os.path.dirname(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r} cannot be written ({probe!r} is not a writable directory).")


def check_json_argument(parser: argparse.ArgumentParser, path: str | None) -> None:
    """Before a tool's rounds: its --json can be written, or argparse's own one line and exit 2."""
    if path:
        try:
            check_writable(path, "--json")
        except ValueError as e:
            parser.error(str(e))


def write_json(path: str | None, payload: dict | list) -> None:
    """`path`'s folders are made as needed: the command checked up front that they can be. Written
    under a name of its own and renamed over `path`: no link there is followed."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = unique_name(path)
        try:
            with os.fdopen(create_file(tmp), "w") as f:
                json.dump(payload, f, indent=2, default=str)
            os.replace(tmp, path)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)


@contextmanager
def progress(total: int, desc: str):
    """A tqdm bar on a terminal; nothing at all in a pipe."""
    if not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, leave=False) as bar:
        yield bar
