"""Completion handles: every asynchronous operation returns one; nothing waits on a global drain."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future


class Handle:
    """The completion of one asynchronous operation: `done()`, `wait()`, callbacks.

    The object that owns the operation's buffer keeps it alive until the handle completes.
    """

    __slots__ = ("_event", "_error", "_callbacks", "_lock")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Handle], None]] = []
        self._lock = threading.Lock()

    @classmethod
    def completed(cls, error: BaseException | None = None) -> Handle:
        h = cls()
        h.set_done(error)
        return h

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete; re-raise the operation's error, if any."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"operation did not complete within {timeout} s")
        if self._error is not None:
            raise self._error

    def exception(self) -> BaseException | None:
        assert self.done()
        return self._error

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call `fn(self)` once complete (at once, in this thread, if it already is)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def set_done(self, error: BaseException | None = None) -> None:
        with self._lock:
            assert not self._event.is_set(), "handle completed twice"
            self._error = error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)


def done_future(value) -> Future:
    """A Future that already holds `value`."""
    f: Future = Future()
    f.set_result(value)
    return f


def handle_of(future: Future) -> Handle:
    """A Handle that completes (with the future's error, if any) when `future` does."""
    h = Handle()
    future.add_done_callback(lambda f: h.set_done(f.exception()))
    return h
