"""Close at interpreter exit what a script left open, before Python stops its thread pools.

An engine or store that is never closed still has work in flight on its background threads when
the script ends: updates on the optimizer thread that wait for moves on the store's movers. At exit
concurrent.futures stops accepting work and joins every pool's threads, so such an update either
fails ("cannot schedule new futures after interpreter shutdown") or waits for ever on a move that
will not run, and the swap file stays on disk. What is registered here is closed first, newest
first (an engine before the store it owns), through the hook concurrent.futures itself uses; its
hooks run in reverse order of registration, and ours is registered after its own. A forked child
closes nothing of its parent's.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook is registered before ours
import itertools
import logging
import os
import threading
import weakref
from typing import Protocol

log = logging.getLogger(__name__)


class Closable(Protocol):
    def close(self) -> None: ...


_open: dict[int, weakref.ref] = {}  # registration number -> what to close
_numbers = itertools.count()
_lock = threading.Lock()


def close_at_exit(obj: Closable) -> int:
    """Close `obj` at exit unless `forget(token)` was called first; held weakly. Returns the token."""
    with _lock:
        token = next(_numbers)
        _open[token] = weakref.ref(obj)
    return token


def forget(token: int) -> None:
    """`obj` was closed by its owner: nothing to do at exit."""
    with _lock:
        _open.pop(token, None)


def _close_all() -> None:
    with _lock:
        pending = [ref() for _, ref in sorted(_open.items(), reverse=True)]
        _open.clear()
    for obj in pending:
        if obj is None:
            continue
        try:
            obj.close()
        except Exception as e:  # noqa: BLE001 - exiting anyway: say so, and close the rest
            log.warning("closing %s at exit failed: %s", type(obj).__name__, e)


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker) holds copies of its parent's engines and stores, and
    # Python runs the hook below as it exits too: closing those copies would delete the parent's
    # swap file and lock. They are the parent's to close.
    global _lock
    _lock = threading.Lock()  # (another thread may have held it at the fork)
    _open.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)

# `threading._register_atexit` runs before non-daemon threads are joined, where concurrent.futures
# registers its own shutdown; plain atexit runs only after that.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_close_all)
else:
    atexit.register(_close_all)
