"""A frozen unit that rested quantized, as values again, from what its checkpoint records
(runtime/checkpoint/layout_record.py): read from the unquantized files it was quantized from (the
originals: a merge lands on the weights the user gave), or decoded from the pre-quantized files it
was read from as stored (the dequantized weights, as the engine's own export writes them).

A checkpoint holds neither: the codes of a base quantized at the start are derived again from it,
and a pre-quantized base is read where it lies. One unit is decoded at a time (a block), so that an
export of a 70B base is bounded by its largest unit, not its size."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

from outcore.runtime.frozen_in_place import UnitSpans
from outcore.runtime.quantized import QuantizedLayout

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8,
           "int8": torch.int8}


def quantized_values(unit: dict, spans: Callable[[list[dict]], UnitSpans]) -> torch.Tensor:
    """The fp32 values of the unit's flat buffer (`unit`: its meta.json entry); `spans` opens (and
    checks) the weights files a record names. ValueError where the checkpoint records neither."""
    record, numel = unit["quantized"], unit["numel"]
    values = torch.zeros(numel, dtype=torch.float32)
    if "original" in record:
        spans(record["original"]).source(0, numel).read_into(values)
        return values
    if "stored" not in record:
        raise ValueError(f"unit {unit['name']!r} rested quantized, and its checkpoint records no file its values can "
                         "be read from (one from before outcore recorded it, or a base the adapters' initialization "
                         "changed as it was read); export from the engine (engine.export) instead.")
    shapes = [tuple(p["shape"]) for p in unit["params"]]
    layout = QuantizedLayout.of(shapes, record["weights"], record["kind"], record["double"],
                                [_DTYPES[d] for d in record["plain_dtypes"]], 1)
    layout.scale_offsets[:] = record["scale_offsets"]
    raw = torch.zeros(layout.padded, dtype=torch.uint8)
    spans(record["stored"]).source(0, layout.padded).read_into(raw)
    names = [SimpleNamespace(state_dict_names=p["names"]) for p in unit["params"]]
    layout.decode_into(raw, values, tuple(p["offset"] for p in unit["params"]), names)  # type: ignore[arg-type]
    return values
