"""Fine-tuning rows read from the files SFT tools read: `.txt` (one document), `.jsonl` (a row a
line), `.json` (a list of rows), `.parquet`, or a directory `datasets.Dataset.save_to_disk` wrote.
Each row comes with where it stands ("line 7" of a `.jsonl`, "row 7" otherwise) for the errors."""

from __future__ import annotations

import json
import os
from typing import Any

Row = tuple[str, dict[str, Any]]  # (where it stands, the row)


def read_rows(path: str) -> list[Row]:
    """Every row of `path`, in order; ValueError naming the file (and the line) where it cannot."""
    if os.path.isdir(path):
        return _saved_dataset(path)
    if not os.path.isfile(path):
        raise ValueError(f"--data {path!r}: no such file or directory.")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".txt":
        with open(path, encoding="utf-8") as f:
            return [("the file", {"text": f.read()})]
    if suffix == ".jsonl":
        return _jsonl(path)
    if suffix == ".json":
        with open(path, encoding="utf-8") as f:
            try:
                rows = json.load(f)
            except ValueError as e:
                raise ValueError(f"{path!r} is not JSON ({e}).") from e
        if not isinstance(rows, list):
            raise ValueError(f"{path!r}: a .json file holds a list of rows; this one holds a {type(rows).__name__}.")
        return [(f"row {i}", _object(row, path, f"row {i}")) for i, row in enumerate(rows, 1)]
    if suffix == ".parquet":
        import pyarrow.parquet  # datasets brings pyarrow

        return [(f"row {i}", row) for i, row in enumerate(pyarrow.parquet.read_table(path).to_pylist(), 1)]
    raise ValueError(f"--data {path!r}: give a .txt, .jsonl, .json or .parquet file, or a directory written by "
                     "datasets' save_to_disk.")


def _jsonl(path: str) -> list[Row]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path!r} line {number} is not JSON ({e}).") from e
            rows.append((f"line {number}", _object(row, path, f"line {number}")))
    return rows


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
