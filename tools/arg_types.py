"""argparse types for the command line's flags: numbers in a range, lists, and the sizes and counts
of runtime/sizes.py."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from outcore.runtime.sizes import human_count, parse_count, parse_size

MOST_STEPS = 10**9  # a billion optimizer steps: centuries at any step time; a larger count is a typo

__all__ = ["MOST_STEPS", "human_count", "int_in", "non_negative_float", "non_negative_int", "parse_count",
           "parse_list", "parse_size", "positive_float", "positive_int", "step_count"]


def parse_list(text: str, parse=int) -> list:
    """'128K,1M,8M' -> [131072, 1048576, 8388608] with `parse` applied to each item."""
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"{text!r} names no values")
    return [parse(t) for t in items]


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    return _ranged(text, int, lambda v: v >= 1, "a whole number of at least 1")


def step_count(text: str) -> int:
    """An argparse type: a number of steps, at least 1 and at most MOST_STEPS."""
    return _ranged(text, int, lambda v: 1 <= v <= MOST_STEPS,
                   f"a whole number of at least 1 and at most {MOST_STEPS:,}")


def non_negative_int(text: str) -> int:
    """An argparse type: an integer of at least 0."""
    return _ranged(text, int, lambda v: v >= 0, "a whole number of at least 0")


def int_in(values: range) -> Callable[[str], int]:
    """An argparse type: an integer in `values`."""
    def parse(text: str) -> int:
        return _ranged(text, int, lambda v: v in values, f"a whole number from {values.start} to {values.stop - 1}")

    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    return _ranged(text, float, lambda v: math.isfinite(v) and v > 0, "a finite number above 0")


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number of at least 0."""
    return _ranged(text, float, lambda v: math.isfinite(v) and v >= 0, "a finite number of at least 0")


def _ranged(text: str, kind, ok, what: str):
    try:
        if not text.isascii():  # int() and float() also read other scripts' digits ('٢٥٦')
            raise ValueError(text)
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value
