"""The NVMe directory a run pages into: its own, private, and not shared with a live run.

- Created with mode 0700 when missing (and the folders made for it removed again if that fails
  midway, or when the run fails to start and leaves them empty: `remove_made`). One that
  exists keeps its mode: outcore changes no folder it did not create. Where others may write (a
  shared `/tmp`-like folder), the files go in a private subfolder, `outcore-<uid>`, said once. One
  owned by another user, and a symbolic link another user made, are refused.
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

_made: dict[str, list[str]] = {}  # a directory this process made -> the folders made for it, innermost first


def prepare_directory(directory: str) -> str:
    """The folder the swap files go in: `directory`, made (0700) with whatever folders above it are
    missing, or where others may write to it, a private subfolder of it. Returns its path.
    Refused: a path that is not a folder, a folder of another user's (other than a shared one), a
    symbolic link another user planted. A directory outcore did not create keeps its mode."""
    directory = os.path.abspath(directory)
    if os.path.lexists(directory):
        st = os.lstat(directory)
        if stat.S_ISLNK(st.st_mode) and st.st_uid != os.getuid():
            raise StorageError(f"nvme_dir {directory!r} is a symbolic link another user made (uid {st.st_uid}); "
                               "outcore does not follow it. Name the folder itself.")
        if not os.path.isdir(directory):
            raise StorageError(f"nvme_dir {directory!r} exists and is not a directory; name a directory.")
    else:
        _make_folders(directory)
    st = os.stat(directory)
    if stat.S_IMODE(st.st_mode) & 0o022:  # others may write here (/tmp): a folder of our own inside
        return _private_subfolder(directory)
    if st.st_uid != os.getuid():
        raise StorageError(f"nvme_dir {directory!r} belongs to another user (uid {st.st_uid}); the swap files hold "
                           "your model's states: name a directory of your own.")
    return directory


def _make_folders(directory: str) -> None:
    """`directory` and the folders above it that are missing, 0700; on failure (a name too long, no
    permission) the ones made here are removed again."""
    missing = []
    path = directory
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    made = []
    try:
        for path in reversed(missing):
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:  # another rank of this run made it a moment ago
                if not os.path.isdir(path):
                    raise
                continue
            made.append(path)
        if made:
            _made[directory] = list(reversed(made))
    except OSError as e:
        for path in reversed(made):
            try:
                os.rmdir(path)
            except OSError:
                break
        raise StorageError(f"cannot create nvme_dir {directory[:200]!r}: {e.strerror}. Name a writable directory "
                           "(and a shorter path, if it is too long).") from e


def remove_made(directory: str) -> None:
    """Remove the folders `prepare_directory` made for `directory` where they are left empty: a run
    that failed to start (a disk full while the base is quantized) leaves no folder behind."""
    for path in _made.pop(os.path.abspath(directory), []):
        try:
            os.rmdir(path)
        except OSError:  # not empty (another rank's files, the user's own): it stays, and so do those above
            break


_said_private: set[str] = set()


def _private_subfolder(shared: str) -> str:
    """`<shared>/outcore-<uid>`, 0700 and this user's, made if missing; refused if someone else's."""
    path = os.path.join(shared, f"outcore-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise StorageError(f"cannot create {path!r} in the shared nvme_dir {shared!r}: {e.strerror}.") from e
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise StorageError(f"nvme_dir {shared!r} is shared with other users, and {path!r}, where outcore keeps "
                           "its files there, is not a private folder of yours (a link, another user's, or open "
                           "to others); remove it, or name a directory of your own.")
    if shared not in _said_private:
        _said_private.add(shared)
        log.warning("nvme_dir %s is writable by other users; the swap files go in a private folder inside it, %s",
                    shared, path)
    return path


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
            who = ("another live run of this process (an engine or trainer still open)"
                   if holder == str(os.getpid()) else "another live run")
            raise StorageError(f"{what} {directory!r} is in use by {who} (pid {holder}, rank {rank}); "
                               f"give each run its own {what}.") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def still_in_place(self) -> bool:
        """Whether the lock file this lock holds is still the one at its path: another program may
        have removed the folder it lies in (a rotation of old checkpoints, say)."""
        if self._fd is None:
            return False
        try:
            here, ours = os.stat(self.path, follow_symlinks=False), os.fstat(self._fd)
        except OSError:
            return False
        return (here.st_ino, here.st_dev) == (ours.st_ino, ours.st_dev)

    def release(self, *, remove: bool) -> None:
        if self._fd is None:
            return
        if remove and self.still_in_place():  # while still held: no other run can have taken it
            os.unlink(self.path)  # (a file already gone with its folder has nothing to remove)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
