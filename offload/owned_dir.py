"""Scratch folders a run makes for itself, and reclaims from runs that died.

A run that is given no `nvme_dir` makes a temporary folder for its swap files and removes it when
it ends. A run killed with SIGKILL cannot remove it, and the folder may hold the model's whole
state. So each such folder holds an `owner.lock`, `flock`ed by its maker for as long as it lives;
the kernel drops the lock when the process dies, however it dies. Making a new folder first sweeps
the same parent for folders of the same prefix whose lock can be taken (their maker is gone) and
that hold only files outcore writes, removes them, and says so once for each.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import re
import shutil
import stat
import tempfile

from outcore.offload.errors import StorageError

log = logging.getLogger(__name__)

OWNER_LOCK = "owner.lock"
_OURS = re.compile(r"^(owner\.lock|rank\d+\.(swap|lock|index\.json|index\.json\.tmp))$")


class OwnedDir:
    """A fresh folder `<parent>/<prefix><random letters>`, this process's until `remove()`."""

    def __init__(self, prefix: str, parent: str | None = None) -> None:
        parent = parent or tempfile.gettempdir()
        reclaim_dead(prefix, parent)
        try:
            self.path = tempfile.mkdtemp(prefix=prefix, dir=parent)
        except OSError as e:
            raise StorageError(f"cannot make a scratch folder in {parent!r}: {e.strerror}; name an nvme_dir "
                               "on a writable disk.") from e
        self._fd: int | None = os.open(os.path.join(self.path, OWNER_LOCK),
                                       os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else holds it
        self._pid = os.getpid()
        os.pwrite(self._fd, f"{self._pid}\n".encode(), 0)
        atexit.register(self.remove)  # a script that ends without closing its engine leaves nothing

    def remove(self) -> None:
        if self._fd is None or os.getpid() != self._pid:  # a forked child's copy: the folder is its parent's
            return
        shutil.rmtree(self.path, ignore_errors=True)  # while still held: no sweep can race it
        os.close(self._fd)
        self._fd = None
        atexit.unregister(self.remove)


def reclaim_dead(prefix: str, parent: str) -> int:
    """Remove the folders `<parent>/<prefix>*` whose makers died; returns the bytes freed."""
    freed = 0
    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(path, OWNER_LOCK), os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # not one of ours, or being made right now
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its run is alive
            files = os.listdir(path)
            if not all(_OURS.match(f) for f in files):
                log.warning("left %s in place: its run died, but it holds files outcore did not write", path)
                continue
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            size = sum(os.lstat(os.path.join(path, f)).st_blocks * 512 for f in files)
            shutil.rmtree(path, ignore_errors=True)
            freed += size
            log.warning("reclaimed %.1f MiB in %s, left by a run that died (pid %s)", size / 2**20, path, pid)
        except OSError:
            continue
        finally:
            os.close(fd)
    return freed
