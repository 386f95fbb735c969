"""What meta.json says of each unit: its split, where each parameter sits in its flat buffer, and for
a frozen unit where its values are found without the engine (the weights files it was read from in
place, or, for one that rested quantized, its unquantized originals or its pre-quantized bytes), so
that a resume on any world size and `outcore export` can rebuild every tensor."""

from __future__ import annotations

from typing import TYPE_CHECKING

from outcore.offload.file_source import FileStamp
from outcore.runtime.frozen_in_place import UnitSpans
from outcore.runtime.quantized import QuantizedLayout

if TYPE_CHECKING:
    from outcore.runtime.checkpoint.sharded_model import ShardedModel


def unit_layouts(sm: ShardedModel) -> list[dict]:
    """Each unit's split, and where each parameter sits in its flat buffer (what `outcore export`
    needs to rebuild the model's tensors from the rank files without the model)."""
    return [{"name": u.name, "numel": u.layout.numel, "padded": u.layout.padded, "shard": u.layout.shard,
             "frozen": u.frozen, "chunks": [[c.start, c.end] for c in u.chunks],
             "params": [{"names": list(slot.state_dict_names), "shape": list(slot.shape), "offset": off}
                        for slot, off in zip(u.plan.slots, u.layout.offsets, strict=True)],
             # a frozen unit read where the weights lie: where, in place of its bytes
             **({"in_place": u.in_place.as_json()} if u.in_place is not None else {}),
             # a frozen unit stored quantized: how; its codes are derived again from the base on resume
             **({"quantized": _quantized(u.quantized, u.original)} if u.quantized is not None else {})}
            for u in sm.units]


def _quantized(layout: QuantizedLayout, original: UnitSpans | None) -> dict:
    """How a frozen unit rested quantized, and where an export finds its values: the spans of the
    unquantized files it was quantized from (`original`, elements of the flat buffer), or of the
    pre-quantized files it was read from as stored (`stored`, bytes of the layout)."""
    kinds = {(p.kind, p.double) for p in layout.parts if p is not None}
    (kind, double), = kinds
    record = {"kind": kind, "double": double, "weights": [p is not None for p in layout.parts],
              "plain_dtypes": [str(d).removeprefix("torch.") for d in layout.plain_dtypes],
              "scale_offsets": list(layout.scale_offsets)}
    if original is not None:
        record["original"] = original.as_json()
    elif layout.stored_in:
        record["stored"] = layout.stored_in[0].as_json()
    return record


def read_files(sm: ShardedModel) -> dict[str, FileStamp]:
    """The weights files a checkpoint refers to: frozen units read where they lie, and the files a
    quantized unit's values are found in (its originals, or its stored bytes)."""
    read: dict[str, FileStamp] = {}
    for u in sm.units:
        q = u.quantized
        for spans in (u.in_place, u.original, *(q.stored_in if q is not None else ())):
            if spans is not None:
                read.update(spans.stamps)
    return read
