"""Packages whose public names load on first use, so that importing a package costs nothing until
a name is used (the command line's torch-free paths stay free of torch)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports `exports[name]` (a module's dotted name) on first use.
    The package also imports the same names under `TYPE_CHECKING`, for the type checker."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
