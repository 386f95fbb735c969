"""The NVMe directory a run pages into: its own, private, and not shared with a live run.

- Created with mode 0700 when missing. One that others may read or write is tightened to 0700 and
  said once; one owned by another user is refused.
- Each rank holds an advisory lock (`flock`) on `rank<R>.lock` for as long as its store is open,
  with its pid written inside. A second live run on the same directory and rank meets one clear
  error naming the directory and the holder's pid. A dead run's lock dies with its process, so the
  next run takes the directory over and reclaims its swap files (they are scratch).
- Files in it are opened without following symbolic links (`O_NOFOLLOW`) and checked to be regular
  files of ours, so a link planted in the directory cannot turn a write elsewhere.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat

from outcore.offload.errors import StorageError

log = logging.getLogger(__name__)


def prepare_directory(directory: str) -> str:
    """Create `directory` (0700) if missing; refuse a path that is not a folder of ours; tighten its mode."""
    directory = os.path.abspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise StorageError(f"nvme_dir {directory!r} exists and is not a directory; name a directory.")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.stat(directory)
    except OSError as e:
        raise StorageError(f"cannot create nvme_dir {directory!r}: {e.strerror}. Name a writable directory.") from e
    if st.st_uid != os.getuid():
        raise StorageError(f"nvme_dir {directory!r} belongs to another user (uid {st.st_uid}); the swap files hold "
                           "your model's states: name a directory of your own.")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(directory, 0o700)
        log.warning("nvme_dir %s was mode %o, open to other users; tightened to 0700", directory,
                    stat.S_IMODE(st.st_mode))
    return directory


def open_private(path: str, flags: int) -> int:
    """`os.open` of a file in the scratch directory that refuses a symbolic link and anything that
    is not a regular file of ours."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        if os.path.islink(path):
            raise StorageError(f"{path!r} is a symbolic link; outcore does not follow links in nvme_dir. "
                               "Remove it, or name another nvme_dir.") from e
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise StorageError(f"{path!r} is not a regular file of yours; remove it, or name another nvme_dir.")
    return fd


class DirectoryLock:
    """This rank's hold on the directory (see the module docstring). `what` names the directory in
    the error (the flag or key it came from); `prefix` keeps two locks of one run apart when one
    folder is named for both (`outcore train --out D --nvme-dir D`)."""

    def __init__(self, directory: str, rank: int, *, what: str = "nvme_dir", prefix: str = "") -> None:
        self.path = os.path.join(directory, f"{prefix}rank{rank}.lock")
        self._fd: int | None = open_private(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            self._fd = None
            raise StorageError(f"{what} {directory!r} is in use by another live run (pid {holder}, rank {rank}); "
                               f"give each run its own {what}.") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self, *, remove: bool) -> None:
        if self._fd is None:
            return
        if remove:
            os.unlink(self.path)  # while still held: no other run can have taken it
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
