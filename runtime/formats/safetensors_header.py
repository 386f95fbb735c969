"""A safetensors file's header, read and checked before any byte of the file is used.

The format: an 8-byte little-endian length N, then N bytes of JSON, then the data section. The
JSON is one object: an optional "__metadata__" object of strings, and per tensor
`{"dtype", "shape", "data_offsets": [begin, end]}` with offsets relative to the data section.

Files come from anywhere (a hub, a colleague), so nothing in the header is trusted: it must be a
JSON object of bounded size; each tensor's dtype known, its shape a list of non-negative integers,
its byte range inside the data section, exactly as long as its shape and dtype need, and the
ranges together covering the data section exactly, none overlapping another. A file that fails is
refused naming the tensor and the file, as the `safetensors` library refuses it; without these
checks a short range is read on into the next tensor's bytes (or past the file's end into memory
never written) and loads as numbers.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

MAX_HEADER = 100 << 20  # the safetensors library's own bound
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


@dataclass(frozen=True, slots=True)
class TensorRange:
    key: str
    dtype: str  # the file's name for it: "F32", "BF16", ...
    shape: tuple[int, ...]
    begin: int  # byte offset of its data in the file
    nbytes: int


def read_header(file: str) -> dict[str, TensorRange]:
    """Every tensor of `file` by its name, each checked; ValueError naming the file and the tensor."""
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file!r} is shorter than a safetensors header's length ({len(head)} bytes).")
        size = int.from_bytes(head, "little")
        end = os.fstat(f.fileno()).st_size
        if not 2 <= size <= min(MAX_HEADER, end - 8):
            raise ValueError(f"{file!r} gives its safetensors header {size} bytes, of a file of {end}: it is not a "
                             "readable safetensors file, or it is truncated.")
        raw = f.read(size)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{file!r}: its safetensors header is not JSON ({type(e).__name__}).") from e
    if not isinstance(header, dict):
        raise ValueError(f"{file!r}: its safetensors header is a JSON {type(header).__name__}, not an object.")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{file!r}: its safetensors __metadata__ is not an object of strings.")
    data = end - 8 - size
    out = {key: _checked(file, key, entry, data, 8 + size) for key, entry in header.items()}
    _tiled(file, out, 8 + size, data)
    return out


def _checked(file: str, key: str, entry: object, data: int, start: int) -> TensorRange:
    def refuse(why: str) -> ValueError:
        return ValueError(f"{file!r}: tensor {key!r} {why}; the file is damaged or not what it claims.")

    if not isinstance(entry, dict):
        raise refuse("is not described by an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise refuse(f"has dtype {dtype!r}, which safetensors does not define")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise refuse(f"has shape {shape!r}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise refuse(f"has data_offsets {offsets!r}, not [begin, end]")
    begin, stop = offsets
    if not 0 <= begin <= stop <= data:
        raise refuse(f"lies at bytes [{begin}, {stop}) of a data section of {data}")
    need = math.prod(shape) * DTYPE_BYTES[dtype]
    if stop - begin != need:
        raise refuse(f"has {stop - begin} bytes where its shape {shape} of {dtype} needs {need}")
    return TensorRange(key, dtype, tuple(shape), start + begin, stop - begin)


def _tiled(file: str, tensors: dict[str, TensorRange], start: int, data: int) -> None:
    """The tensors' ranges, in order, cover the data section exactly: each begins where the one before
    ended (an overlap gives one tensor another's bytes; a gap holds bytes no tensor names), and the
    last ends at the file's end. The safetensors library asks the same."""
    at = start
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.nbytes)):
        if t.begin != at:
            why = ("shares bytes with the tensor before it" if t.begin < at
                   else "leaves bytes no tensor holds before it")
            raise ValueError(f"{file!r}: tensor {t.key!r} {why}; the file is damaged or not what it claims.")
        at = t.begin + t.nbytes
    if at != start + data:
        raise ValueError(f"{file!r}: its last {start + data - at} bytes belong to no tensor; the file is damaged or "
                         "not what it claims.")
