"""Sizes and counts as people write and read them: bytes (4G, 512M, 128K read; 1.5 GiB written)
and parameter counts (125M, 13B), for the command line, config files and the lines users see."""

from __future__ import annotations

import math

_BINARY = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
           "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


MOST_BYTES = 1 << 60  # 1 EiB: no machine holds more; a larger size is a typo


def parse_size(text: str) -> int:
    """'4G' -> 4294967296 (binary multiples; a fraction of a unit is rounded down to whole bytes);
    raises ValueError with the accepted forms."""
    s = text.strip().upper()
    num = s.rstrip("KMGTIB")
    unit = s[len(num):]
    value = _number(num)
    if unit not in _BINARY or not math.isfinite(value) or value < 0:
        raise ValueError(f"{text!r} is not a size; write e.g. 4096, 128K, 8M or 4G")
    if value * _BINARY[unit] > MOST_BYTES:
        raise ValueError(f"{text!r} is past any machine's memory or disk (at most {human_bytes(MOST_BYTES)})")
    if _BINARY[unit] == 1 and value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes; write e.g. 512 or 0.5K")
    return int(value * _BINARY[unit])


def _number(text: str) -> float:
    """A number as written in ASCII (Python's float() also takes other scripts' digits, '٢٥٦'), or nan."""
    if not text.isascii() or "_" in text:
        return math.nan
    try:
        return float(text)
    except ValueError:
        return math.nan


_COUNT_UNITS = (("", 1), ("K", 10**3), ("M", 10**6), ("B", 10**9), ("T", 10**12))  # as counts are written
_COUNT = {**dict(_COUNT_UNITS), "G": 10**9}  # and read: G too, for billions
_MOST_PARAMETERS = 10**15  # a thousand times the largest models trained; beyond it a count is a typo


def parse_count(text: str) -> int:
    """'13B' -> 13_000_000_000, '125M' -> 125_000_000 (decimal: parameter counts, not bytes)."""
    s = text.strip().upper().replace("_", "")
    unit = s[-1:] if s[-1:] in _COUNT and s[-1:] else ""
    value = _number(s[: len(s) - len(unit)])
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


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(n) < 1024 or unit == "EiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError
