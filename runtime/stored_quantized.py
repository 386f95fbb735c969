"""Weights a directory holds already quantized, as bitsandbytes saves a 4-bit or 8-bit layer: read in place.

`save_pretrained` of a model loaded 4-bit writes, for each quantized weight `W`, its codes under
`W` (uint8, two a byte) beside `W.quant_map`, `W.absmax` and, under double quantization,
`W.nested_absmax` and `W.nested_quant_map`, and its state as JSON bytes under
`W.quant_state.bitsandbytes__nf4` (or `__fp4`): the shape, the block sizes and the nested scales'
offset. An 8-bit layer's weight `M.weight` is its codes (int8) beside `M.SCB` (an fp32 absmax a
row) and `M.weight_format` (0: rows as stored). `stored_quantized` takes these tensors out of a
file's index and returns one `StoredQuantized` per weight; the engine then rests the weight's unit
on spans of those tensors in the files (runtime/quantized_base.py; runtime/quantized.py's layout is
the same parts in the same order), never copying a byte into the swap file, and decodes them as it
decodes codes it made itself.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from outcore.runtime.quantized import BLOCK, NESTED_BLOCK, QuantizedWeight, code_table

log = logging.getLogger(__name__)

STATE_MARK = ".quant_state.bitsandbytes__"  # in the name of a 4-bit weight's saved state
_PARTS = {"codes": "", "code": ".quant_map", "absmax": ".absmax", "nested_absmax": ".nested_absmax",
          "nested_code": ".nested_quant_map"}


@dataclass(frozen=True)
class StoredQuantized:
    """A weight saved quantized: its layout, its parts' stored tensors and its nested scales' offset."""

    weight: QuantizedWeight
    parts: dict[str, Any]  # part name -> the StoredTensor holding it (runtime/pretrained.py)
    offset: float | None


def stored_quantized(tensors: dict[str, Any]) -> dict[str, StoredQuantized]:
    """The 4-bit and 8-bit weights among `tensors` (a file index's StoredTensors), by name; their
    tensors (codes, tables, scales, state) are removed from `tensors`. ValueError naming a weight
    saved in a way outcore does not read."""
    out = _stored_int8(tensors)
    for key in [k for k in tensors if STATE_MARK in k]:
        name, kind = key.split(STATE_MARK)
        state_tensor = tensors.pop(key)
        state = _state(state_tensor)
        if kind not in ("nf4", "fp4") or state.get("blocksize") != BLOCK or \
                state.get("nested_blocksize", NESTED_BLOCK) != NESTED_BLOCK:
            raise ValueError(f"{state_tensor.file!r} holds {name!r} quantized as {kind} in blocks of "
                             f"{state.get('blocksize')}: outcore reads bitsandbytes' 4-bit nf4 and fp4 in blocks of "
                             f"{BLOCK} (nested {NESTED_BLOCK}), as transformers saves them.")
        double = name + _PARTS["nested_absmax"] in tensors
        weight = QuantizedWeight(_shape(state, state_tensor), kind, double)
        offset = _offset(state, state_tensor) if double else None
        parts = {}
        for part, _, nbytes in weight.parts():
            stored = tensors.pop(name + _PARTS[part], None)
            if stored is None or stored.nbytes != nbytes:
                raise ValueError(f"{state_tensor.file!r}: the 4-bit weight {name!r} has "
                                 + ("no" if stored is None else f"a {stored.nbytes}-byte")
                                 + f" {name + _PARTS[part]!r} (expected {nbytes} bytes): the file is not as "
                                 "bitsandbytes saves a 4-bit layer.")
            parts[part] = stored
        _check_tables(name, kind, parts)
        out[name] = StoredQuantized(weight, parts, offset)
    return out


def _stored_int8(tensors: dict[str, Any]) -> dict[str, StoredQuantized]:
    out = {}
    for key in [k for k in tensors if k.endswith(".SCB")]:
        module = key.removesuffix(".SCB")
        name = module + ".weight"
        codes, row_absmax = tensors.get(name), tensors[key]
        if codes is None or codes.dtype != torch.int8 or len(codes.shape) != 2:
            continue  # not a layer bitsandbytes saved 8-bit
        weight = QuantizedWeight(tuple(codes.shape), "int8", False)
        form = tensors.pop(module + ".weight_format", None)
        if form is not None and _read(form) not in (b"\x00", b""):
            raise ValueError(f"{form.file!r} holds {name!r} 8-bit in a tiled format ({form.key!r} is not 0): outcore "
                             "reads bitsandbytes' 8-bit weights in rows, as transformers saves them today.")
        if row_absmax.nbytes != weight.shape[0] * 4:
            raise ValueError(f"{row_absmax.file!r}: the 8-bit weight {name!r} has a {row_absmax.nbytes}-byte {key!r} "
                             f"(expected {weight.shape[0] * 4}): the file is not as bitsandbytes saves an 8-bit layer.")
        out[name] = StoredQuantized(weight, {"codes": tensors.pop(name), "row_absmax": tensors.pop(key)}, None)
    return out


def _read(stored: Any) -> bytes:
    fd = os.open(stored.file, os.O_RDONLY)
    try:
        return os.pread(fd, stored.nbytes, stored.begin)
    finally:
        os.close(fd)


def _state(stored: Any) -> dict:
    raw = _read(stored)
    try:
        state = json.loads(raw.decode("utf-8"))
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
        return state
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{stored.file!r}: {stored.key!r} is not bitsandbytes' saved state ({e}).") from None



def _shape(state: dict, stored: Any) -> tuple[int, ...]:
    shape = state.get("shape")
    if not isinstance(shape, list) or not shape or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ValueError(f"{stored.file!r}: {stored.key!r} gives the shape {shape!r}; bitsandbytes saves a list of "
                         "positive sizes. The file is damaged: save the model again.")
    return tuple(shape)


def _offset(state: dict, stored: Any) -> float:
    offset = state.get("nested_offset")
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
        raise ValueError(f"{stored.file!r}: {stored.key!r} gives the nested scales' offset {offset!r}; bitsandbytes "
                         "saves a finite number under double quantization. The file is damaged: save the model again.")
    return float(offset)


def _check_tables(name: str, kind: str, parts: dict[str, Any]) -> None:
    """The code tables are fixed (NF4's or FP4's 16 values, the nested scales' 256): a stored one that
    differs (zeros) would decode every weight of the layer wrongly, without an error."""
    for part, table in (("code", kind), ("nested_code", "dynamic")):
        stored = parts.get(part)
        if stored is None:
            continue
        values = torch.frombuffer(bytearray(_read(stored)), dtype=torch.float32)
        if not torch.equal(values, code_table(table)):
            raise ValueError(f"{stored.file!r}: {stored.key!r} is not bitsandbytes' {table} code table (it holds "
                             f"{values[:4].tolist()}...): every weight of {name!r} would decode wrongly. The file is "
                             "damaged: save the model again.")
