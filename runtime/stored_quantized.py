"""Weights a directory holds already quantized, as bitsandbytes saves a 4-bit layer: read in place.

`save_pretrained` of a model loaded 4-bit writes, for each quantized weight `W`, its codes under
`W` (uint8, two a byte) beside `W.quant_map`, `W.absmax` and, under double quantization,
`W.nested_absmax` and `W.nested_quant_map`, and its state as JSON bytes under
`W.quant_state.bitsandbytes__nf4` (or `__fp4`): the shape, the block sizes and the nested scales'
offset. `stored_quantized` takes these tensors out of a file's index and returns one
`StoredQuantized` per weight; the engine then rests the weight's unit on spans of those tensors in
the files (runtime/quantized.py's layout is the same parts in the same order), never copying a
byte into the swap file, and decodes them as it decodes codes it made itself.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from outcore.offload.file_source import FileSpan
from outcore.runtime.config import Config
from outcore.runtime.frozen_in_place import UnitSpans
from outcore.runtime.quantized import BLOCK, NESTED_BLOCK, QuantizedWeight, linear_weights

if TYPE_CHECKING:
    from outcore.runtime.flat_unit import FlatUnit
    from outcore.runtime.pretrained import PretrainedWeights, StoredTensor
    from outcore.runtime.units import ParamSlot

log = logging.getLogger(__name__)

_STATE = ".quant_state.bitsandbytes__"
_PARTS = {"codes": "", "code": ".quant_map", "absmax": ".absmax", "nested_absmax": ".nested_absmax",
          "nested_code": ".nested_quant_map"}


@dataclass(frozen=True)
class StoredQuantized:
    """A weight saved 4-bit: its layout, its parts' stored tensors and its nested scales' offset."""

    weight: QuantizedWeight
    parts: dict[str, StoredTensor]
    offset: float | None


def stored_quantized(tensors: dict[str, Any]) -> dict[str, StoredQuantized]:
    """The 4-bit weights among `tensors` (a file index's StoredTensors), by name; their tensors
    (codes, tables, scales, state) are removed from `tensors`. ValueError naming a weight saved in
    a way outcore does not read."""
    out = {}
    for key in [k for k in tensors if _STATE in k]:
        name, kind = key.split(_STATE)
        state_tensor = tensors.pop(key)
        state = _state(state_tensor)
        if kind not in ("nf4", "fp4") or state.get("blocksize") != BLOCK or \
                state.get("nested_blocksize", NESTED_BLOCK) != NESTED_BLOCK:
            raise ValueError(f"{state_tensor.file!r} holds {name!r} quantized as {kind} in blocks of "
                             f"{state.get('blocksize')}: outcore reads bitsandbytes' 4-bit nf4 and fp4 in blocks of "
                             f"{BLOCK} (nested {NESTED_BLOCK}), as transformers saves them.")
        double = name + _PARTS["nested_absmax"] in tensors
        weight = QuantizedWeight(tuple(int(d) for d in state["shape"]), kind, double)
        parts = {}
        for part, _, nbytes in weight.parts():
            stored = tensors.pop(name + _PARTS[part], None)
            if stored is None or stored.nbytes != nbytes:
                raise ValueError(f"{state_tensor.file!r}: the 4-bit weight {name!r} has "
                                 + ("no" if stored is None else f"a {stored.nbytes}-byte")
                                 + f" {name + _PARTS[part]!r} (expected {nbytes} bytes): the file is not as "
                                 "bitsandbytes saves a 4-bit layer.")
            parts[part] = stored
        out[name] = StoredQuantized(weight, parts, float(state["nested_offset"]) if double else None)
    return out


def _state(stored: StoredTensor) -> dict:
    fd = os.open(stored.file, os.O_RDONLY)
    try:
        raw = os.pread(fd, stored.nbytes, stored.begin)
    finally:
        os.close(fd)
    try:
        state = json.loads(raw.decode("utf-8"))
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
        return state
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{stored.file!r}: {stored.key!r} is not bitsandbytes' saved state ({e}).") from None


def as_stored(config: Config, pretrained: PretrainedWeights | None) -> Config:
    """`config` with the quantization the weights are stored in: taken where `Config.quantize` is
    unset (said once), refused where it names another."""
    if pretrained is None or not pretrained.quantized:
        return config
    settings = {(q.weight.kind, q.weight.double) for q in pretrained.quantized.values()}
    if len(settings) > 1:
        raise ValueError(f"weights {pretrained.path!r} hold 4-bit weights quantized in several ways "
                         f"({sorted(settings)}); outcore reads one.")
    (kind, double), = settings
    if config.quantize is None:
        log.info("weights %s are stored 4-bit (%s%s): read as stored", pretrained.path, kind,
                 ", double quantization" if double else "")
        return dataclasses.replace(config, quantize=kind, quantize_double=double)
    if (config.quantize, config.quantize_double) != (kind, double):
        raise ValueError(f"weights {pretrained.path!r} are stored 4-bit as {kind} (quantize_double={double}), and the "
                         f"config asks for {config.quantize} (quantize_double={config.quantize_double}): give the "
                         "stored setting, or leave quantize unset to take it.")
    return config


def quantized_slots(pretrained: PretrainedWeights | None, kept: set[nn.Module], compute: torch.dtype
                    ) -> tuple[Callable[[ParamSlot], bool], Callable[[ParamSlot], torch.dtype]]:
    """Which parameters rest quantized and what a quantized unit's other parameters are stored in:
    the files' 4-bit weights and their stored dtypes (read as stored, in place) where the weights
    hold any; else every Linear weight not `kept`, the rest in the `compute` dtype."""
    if pretrained is None or not pretrained.quantized:
        return linear_weights(kept), lambda _slot: compute

    def stored_dtype(slot: ParamSlot) -> torch.dtype:
        stored = pretrained.as_stored(slot)
        return stored.dtype if stored is not None and stored.dtype is not None else compute

    return (lambda slot: pretrained.quantized_of(slot) is not None), stored_dtype


def stored_spans(unit: FlatUnit, pretrained: PretrainedWeights) -> UnitSpans | None:
    """The spans of the files a quantized unit's stored bytes are, where the files hold every one of
    its quantized weights 4-bit and its other parameters in the dtype its layout stores them in
    (each weight's nested-scales offset is taken from its saved state); else None."""
    q = unit.quantized
    assert q is not None
    spans: list[FileSpan] = []
    for i, (slot, part, at) in enumerate(zip(unit.plan.slots, q.parts, q.offsets, strict=True)):
        if part is None:
            stored = pretrained.as_stored(slot)
            if stored is None or stored.dtype != q.plain_dtypes[i]:
                return None
            spans.append(FileSpan(stored.file, stored.begin, torch.uint8, stored.nbytes, at))
            continue
        saved = pretrained.quantized_of(slot)
        if saved is None:
            return None
        q.scale_offsets[i] = saved.offset
        for name, within, nbytes in part.parts():
            tensor = saved.parts[name]
            spans.append(FileSpan(tensor.file, tensor.begin, torch.uint8, nbytes, at + within))
    return UnitSpans(tuple(spans), {s.path: pretrained.stamps[s.path] for s in spans})
