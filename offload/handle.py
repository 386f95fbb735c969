"""The one completion handle: fetches, puts, write-backs, evictions and swap-file I/O each return a
`Handle`; nothing waits on a global drain.

As kvikio's futures: `done()`, `wait()` (the error, if any, raised), `result()` (the value: a
fetched tensor, None for a write), and callbacks run once it completes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Handle(Generic[T]):
    """The completion of one asynchronous operation, and its value.

    The object that owns the operation's buffer keeps it alive until the handle completes.
    """

    __slots__ = ("_event", "_error", "_value", "_callbacks", "_lock")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._value: Any = None
        self._callbacks: list[Callable[[Handle[T]], None]] = []
        self._lock = threading.Lock()

    @classmethod
    def completed(cls, value: Any = None) -> Handle[Any]:
        """A handle already done, holding `value`."""
        h: Handle[Any] = cls()
        h.set_result(value)
        return h

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete; re-raise the operation's error, if any."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"operation did not complete within {timeout} s")
        if self._error is not None:
            raise self._error

    def result(self, timeout: float | None = None) -> T:
        """`wait`, then the operation's value."""
        self.wait(timeout)
        return self._value

    def exception(self) -> BaseException | None:
        """The operation's error, or None; only once it is done."""
        assert self.done(), "exception() of a handle still running"
        return self._error

    def outcome(self, timeout: float | None = None) -> BaseException | None:
        """Wait until it is done, whatever its outcome; then its error, or None (not raised)."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"operation did not complete within {timeout} s")
        return self._error

    def add_done_callback(self, fn: Callable[[Handle[T]], None]) -> None:
        """Call `fn(self)` once complete (at once, in this thread, if it already is)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def set_result(self, value: T) -> None:
        self._complete(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._complete(None, error)

    def set_done(self, error: BaseException | None = None) -> None:
        """Complete an operation that has no value (a write): with `error`, if it failed."""
        self._complete(None, error)

    def follow(self, other: Handle[Any]) -> None:
        """Complete as `other` does, with its value or its error."""
        other.add_done_callback(lambda h: self._complete(h._value, h._error))

    def _complete(self, value: Any, error: BaseException | None) -> None:
        with self._lock:
            assert not self._event.is_set(), "handle completed twice"
            self._value, self._error = value, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
