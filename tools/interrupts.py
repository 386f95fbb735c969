"""SIGTERM and Ctrl-C for the command line: a clean stop, one line, exit 128 + the signal.

`outcore` installs `handle_signals()` for the whole command. Outside a training loop a signal
stops the command at once with `Interrupted`, which unwinds through every `finally` (stores
closed, scratch removed). Inside `step_boundaries()` the first signal only asks the loop to stop
after the step it is in (`requested_stop()`, which the loop asks at each step's end, then saves a
checkpoint and its summary); a second one during the step stops at once. Signals that arrive
once the way out has begun are ignored, so that it finishes.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The command was stopped by a signal. A BaseException, as KeyboardInterrupt is, so that no
    `except Exception` on the way out swallows it."""

    def __init__(self, signum: int, where: str = "") -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}{where}")


class _State:
    deferring = 0  # step_boundaries() blocks open
    pending: int | None = None  # a signal the loop has not yet acted on
    stopping = False  # Interrupted raised: the way out (closing stores, removing scratch) is not cut short


_state = _State()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if _state.stopping:
        return
    if _state.deferring and _state.pending is None:
        _state.pending = signum
        if sys.stderr.isatty():  # someone waiting at a terminal; a log gets the one closing line only
            print(f"outcore: {signal.Signals(signum).name} received; stopping after this step "
                  "(send it again to stop now)", file=sys.stderr, flush=True)
        return
    _state.stopping = True
    raise Interrupted(signum)


@contextlib.contextmanager
def handle_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Interrupted` (or are deferred, see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _on_signal) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _state.pending, _state.stopping = None, False


@contextlib.contextmanager
def step_boundaries() -> Iterator[None]:
    """Within: a first signal waits for the loop to call `requested_stop()`."""
    _state.deferring += 1
    try:
        yield
    finally:
        _state.deferring -= 1


def requested_stop() -> int | None:
    """At a step boundary: the signal that arrived during the step, or None. Once one has, further
    signals are ignored, so that the caller's way out (a checkpoint, a summary) is not cut short."""
    if _state.pending is None:
        return None
    signum, _state.pending = _state.pending, None
    _state.stopping = True
    return signum
