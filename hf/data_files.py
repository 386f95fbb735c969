"""Fine-tuning rows read from the files SFT tools read: `.txt` (one document), `.jsonl` (a row a
line), `.json` (a list of rows), `.parquet`, or a directory `datasets.Dataset.save_to_disk` wrote.
Each row comes with where it stands ("line 7" of a `.jsonl`, "row 7" otherwise) for the errors."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

Row = tuple[str, dict[str, Any]]  # (where it stands, the row)
QUOTE_LIMIT = 200  # characters of a row (or of what a row made) an error quotes


def quoted(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """`repr(value)`, cut to `limit` characters (and saying how long it was): a 20 MB row is not echoed."""
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def read_rows(path: str) -> list[Row]:
    """Every row of `path`, in order; ValueError naming the file (and the line) where it cannot."""
    if os.path.isdir(path):
        return _saved_dataset(path)
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"--data {path!r} is not a regular file (a FIFO, a device or a socket): outcore reads the "
                         "data more than once; save it to a file.")
    if not os.path.isfile(path):
        raise ValueError(f"--data {path!r}: no such file or directory.")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".txt":
        return [("the file", {"text": read_text(path)})]
    if suffix == ".jsonl":
        return _jsonl(path)
    if suffix == ".json":
        rows = _parsed(read_text(path), path)
        if not isinstance(rows, list):
            raise ValueError(f"{path!r}: a .json file holds a list of rows; this one holds a {type(rows).__name__}.")
        return [(f"row {i}", _object(row, path, f"row {i}")) for i, row in enumerate(rows, 1)]
    if suffix == ".parquet":
        import pyarrow.parquet  # datasets brings pyarrow

        return [(f"row {i}", row) for i, row in enumerate(pyarrow.parquet.read_table(path).to_pylist(), 1)]
    raise ValueError(f"--data {path!r}: give a .txt, .jsonl, .json or .parquet file, or a directory written by "
                     "datasets' save_to_disk.")


def read_text(path: str, what: str = "") -> str:
    """A UTF-8 file's text; ValueError naming the file and the line of the first byte that is not."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{what}{path!r} line {line} is not UTF-8 ({e.reason} at byte {e.start:,}); save the file "
                         "as UTF-8.") from None


def _jsonl(path: str) -> list[Row]:
    rows = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path!r} line {number} is not UTF-8 ({e.reason} at byte {e.start:,} of the line); "
                                 "save the file as UTF-8.") from None
            del raw
            if not line.strip():
                continue
            row = _parsed(line, path, number)
            rows.append((f"line {number}", _object(row, path, f"line {number}")))
    return rows


def _parsed(text: str, path: str, line: int | None = None) -> Any:
    """`text` (line `line` of a .jsonl, or a whole .json) as JSON; a ValueError naming the file and
    line where it is not, or nests deeper than the reader goes."""
    at = f" line {line}" if line is not None else ""
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path!r}{at} is not JSON ({e}).") from e
    except RecursionError:
        deep = line if line is not None else _too_deep(text)
        raise ValueError(f"{path!r} line {deep} nests JSON deeper than Python's reader goes (about "
                         f"{sys.getrecursionlimit()} levels); no fine-tuning row needs that.") from None


def _too_deep(text: str) -> int:
    """The line of `text` (JSON) where its nesting first passes the interpreter's recursion limit."""
    depth, in_string, escaped, line = 0, False, False, 1
    for c in text:
        if c == "\n":
            line += 1
        if in_string:
            escaped, in_string = (not escaped and c == "\\"), in_string and (escaped or c != '"')
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            if depth >= sys.getrecursionlimit() // 2:
                return line
        elif c in "]}":
            depth -= 1
    return line


def _object(row: Any, path: str, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ValueError(f"{path!r} {where} is a {type(row).__name__}, not an object of fields.")
    return row


def _saved_dataset(path: str) -> list[Row]:
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"--data {path!r} is a directory but not one datasets' save_to_disk wrote ({e}).") from e
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"--data {path!r} holds the splits {sorted(loaded)}; name the split's own directory.")
        loaded = loaded["train"]
    return [(f"row {i}", dict(row)) for i, row in enumerate(loaded, 1)]
