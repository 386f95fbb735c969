"""A settings dataclass's values checked against its own type hints, so that a value of the wrong
kind read from a file (`prefetch_depth: 2.5`, `stage: true`, `nvme_dir: 5`) is one error naming
the key, not a TypeError deep in the run or a silent surprise (`True in (1, 2, 3)` holds)."""

from __future__ import annotations

import dataclasses
import math
import os
import reprlib
import types
import typing
from typing import Any, Union

_WORDS = {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
          type(None): "null (None)"}


_QUOTE = reprlib.Repr()  # Python 3.11's takes no keywords
_QUOTE.maxlevel, _QUOTE.maxstring, _QUOTE.maxother = 3, 80, 80
_QUOTE.maxlist = _QUOTE.maxtuple = _QUOTE.maxdict = _QUOTE.maxset = 8
QUOTE_LIMIT = 200  # characters of a value an error quotes: a value written by a YAML alias can be huge


def quoted(value: Any) -> str:
    """`repr(value)` for an error message, bounded in time and to QUOTE_LIMIT characters."""
    text = _QUOTE.repr(value)
    return text if len(text) <= QUOTE_LIMIT else text[: QUOTE_LIMIT - 3] + "..."


def check_fields(obj: Any, prefix: str = "") -> None:
    """Raise ValueError for the first field of `obj` whose value does not fit its type hint.

    Harmless conversions are made in place: an integral float (1e9 in JSON) for an int, a path for
    a string, a list for a tuple. A bool is never taken for a number.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        hint = hints[f.name]
        value = getattr(obj, f.name)
        ok, converted = _fit(value, hint)
        if not ok:
            raise ValueError(f"{prefix}{f.name}={quoted(value)}: must be {_describe(hint)}.")
        if converted is not value:
            object.__setattr__(obj, f.name, converted)  # frozen dataclasses too


def _fit(value: Any, hint: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True, value
    if origin in (Union, types.UnionType):
        for arm in typing.get_args(hint):
            ok, converted = _fit(value, arm)
            if ok:
                return True, converted
        return False, value
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if isinstance(value, bool):
        return False, value
    if hint is int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return True, int(value)
        return isinstance(value, int), value
    if hint is float:
        return isinstance(value, (int, float)), float(value) if isinstance(value, (int, float)) else value
    if hint is str:
        if isinstance(value, os.PathLike):
            return True, os.fspath(value)
        return isinstance(value, str), value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return False, value
        args = typing.get_args(hint)
        arms = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(arms) != len(value):
            return False, value
        fitted = [_fit(v, a) for v, a in zip(value, arms, strict=True)]
        return all(ok for ok, _ in fitted), tuple(v for _, v in fitted)
    if origin is dict:
        return isinstance(value, dict), value
    return isinstance(value, hint), value


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_describe(args[0]).removeprefix('a ')}s"
        return f"a list of {len(args)} ({', '.join(_describe(a) for a in args)})"
    if origin is dict:
        return "a mapping"
    if hint in _WORDS:
        return _WORDS[hint]
    return f"a mapping of {getattr(hint, '__name__', hint)} settings"
