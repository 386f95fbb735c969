"""Sizes as people write them on a command line: bytes (4G, 512M, 128K) and counts (125M, 13B)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

_BINARY = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
           "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """'4G' -> 4294967296 (binary multiples); raises ValueError with the accepted forms."""
    s = text.strip().upper()
    num = s.rstrip("KMGTIB")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if unit not in _BINARY or not math.isfinite(value) or value < 0:
        raise ValueError(f"{text!r} is not a size; write e.g. 4096, 128K, 8M or 4G")
    return int(value * _BINARY[unit])


_COUNT_UNITS = (("", 1), ("K", 10**3), ("M", 10**6), ("B", 10**9), ("T", 10**12))  # as counts are written
_COUNT = {**dict(_COUNT_UNITS), "G": 10**9}  # and read: G too, for billions
_MOST_PARAMETERS = 10**15  # a thousand times the largest models trained; beyond it a count is a typo


def parse_count(text: str) -> int:
    """'13B' -> 13_000_000_000, '125M' -> 125_000_000 (decimal: parameter counts, not bytes)."""
    s = text.strip().upper().replace("_", "")
    unit = s[-1:] if s[-1:] in _COUNT and s[-1:] else ""
    try:
        value = float(s[: len(s) - len(unit)])
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a count; write e.g. 125M, 1.3B or 13B")
    if value <= 0:
        raise ValueError(f"{text!r}: a parameter count must be positive")
    count = int(value * _COUNT[unit])
    if count > _MOST_PARAMETERS:
        raise ValueError(f"{text!r}: a parameter count of at most {human_count(_MOST_PARAMETERS)}")
    return count


def human_count(n: float) -> str:
    """A parameter count as `parse_count` reads it, to three significant digits: 512, 82.3K, 14.5M, 1.3B."""
    for i, (unit, scale) in enumerate(_COUNT_UNITS):
        value = float(f"{n / scale:.3g}")
        if abs(value) < 1000 or i == len(_COUNT_UNITS) - 1:
            return f"{value:g}{unit}"
    raise AssertionError


def parse_list(text: str, parse=int) -> list:
    """'128K,1M,8M' -> [131072, 1048576, 8388608] with `parse` applied to each item."""
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"{text!r} names no values")
    return [parse(t) for t in items]


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    return _ranged(text, int, lambda v: v >= 1, "a whole number of at least 1")


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
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value
