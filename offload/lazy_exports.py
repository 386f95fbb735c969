"""Packages whose public names load on first use, so that importing a package costs nothing until
a name is used (the command line's torch-free paths stay free of torch)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports `exports[name]` (a module's dotted name) on first use:
    the name from it, or the module itself where it is the package's own `package.name`.
    The package also imports the same names under `TYPE_CHECKING`, for the type checker."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(exports[name])
        return module if exports[name] == f"{package}.{name}" else getattr(module, name)  # a subpackage itself

    return __getattr__
