"""A config's values as the text of the file format its suffix names: .json, .yaml/.yml or .toml.

`Config.to_file` and `outcore tune --out` write through here, so that a file named `.toml` holds
TOML and `Config.from_file` reads back what was written. TOML has no null: a setting that is None
is left out when None is its default (it reads back as None), and `grad_clip`'s None is written as
0, which `Config` reads as no clipping.
"""

from __future__ import annotations

import json
import os
from typing import Any

SUFFIXES = (".json", ".yaml", ".yml", ".toml")
_TOML_NONE = {"grad_clip": 0.0}  # None whose default is not None, as the value that reads back as None


def config_format(path: str | os.PathLike) -> str:
    """The suffix of a config file's path, refused unless outcore reads it."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in SUFFIXES:
        raise ValueError(f"config {path!r}: use a .json, .yaml, .yml or .toml file.")
    return ext


def write_values(path: str | os.PathLike, values: dict[str, Any]) -> None:
    """Write `values` as the file `path` names, its folders made as needed."""
    text = render(values, config_format(path))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def render(values: dict[str, Any], ext: str) -> str:
    """`values` (plain data: `Config.to_dict()`) as the text of a `ext` file."""
    if ext == ".json":
        return json.dumps(values, indent=2) + "\n"
    if ext in (".yaml", ".yml"):
        import yaml

        return str(yaml.safe_dump(values, sort_keys=False, default_flow_style=False))
    return _toml(values)


def _toml(values: dict[str, Any]) -> str:
    lines, tables = [], []
    for key, value in values.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif value is not None or key in _TOML_NONE:
            lines.append(f"{key} = {_toml_value(_TOML_NONE[key] if value is None else value)}")
    for name, table in tables:  # after every plain key: a key below [name] belongs to that table
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # TOML's floats, inf and nan included
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: the same quotes and escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"a config value of type {type(value).__name__} has no file form")
