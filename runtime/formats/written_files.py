"""Files and folders outcore writes where others may write too: names unique to the writer, created
exclusively, no symbolic link followed, and a folder replaced whole.

- `unique_name(path)`: `.<name>.<pid>-<random>.tmp` beside `path`. Created with O_EXCL (a folder
  with mkdir), so nothing already there, a file or a link planted under a guessed name, is ever
  written through or replaced.
- `create_file(path)`: O_CREAT | O_EXCL | O_NOFOLLOW.
- `open_appending(path)`: a log opened without following a link.
- `replace_whole(new, old)`: the folder `old` becomes `new` in one step, with Linux's
  renameat2(RENAME_EXCHANGE). Where that call is missing (another OS, a filesystem without it),
  two renames do it, said once: a kill between them leaves no folder at `old` and the previous one
  beside it under a `.old` name, never a mix of the two.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import stat

log = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_said_no_exchange = False


def unique_name(path: str, suffix: str = ".tmp") -> str:
    """A name beside `path` for this writer alone."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{os.getpid()}-{secrets.token_hex(4)}{suffix}")


def nearest_existing(path: str) -> str:
    """`path`, or the nearest folder above it that exists (where the folders to make would start)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def create_file(path: str, mode: int = 0o644) -> int:
    """A new file at `path` (refused if anything, a link included, is there); returns its fd."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def open_appending(path: str, *, truncate: bool) -> int:
    """`path` opened to append to (or emptied first), refusing a symbolic link or what is not a
    regular file; returns its fd."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_TRUNC if truncate else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(e.errno, f"{path!r} is a symbolic link; outcore writes no file through a link", path) from e
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path!r} is not a regular file", path)
    return fd


def link_tree(src: str, dst: str) -> None:
    """`dst` made to hold what `src` holds, by hard links: links stay links, folders are made anew."""
    st = os.lstat(src)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISDIR(st.st_mode):
        os.mkdir(dst, stat.S_IMODE(st.st_mode))
        for name in os.listdir(src):
            link_tree(os.path.join(src, name), os.path.join(dst, name))
    else:
        os.link(src, dst, follow_symlinks=False)


def replace_whole(new: str, old: str) -> None:
    """The folder at `old` becomes the folder `new` in one step; what was at `old` is then at `new`."""
    global _said_no_exchange
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        exchange = libc.renameat2
    except (OSError, AttributeError):
        exchange = None
    if exchange is not None:
        if exchange(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(old), _RENAME_EXCHANGE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(code, f"cannot swap {new!r} in for {old!r}: {os.strerror(code)}", old)
    if not _said_no_exchange:
        _said_no_exchange = True
        log.warning("this system cannot swap two folders in one step; %s is replaced by two renames, and a "
                    "kill between them would leave it missing, the previous one beside it", old)
    aside = unique_name(old, ".old")
    os.rename(old, aside)
    os.rename(new, old)
    os.rename(aside, new)
