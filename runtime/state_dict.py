"""Whole-model views of sharded parameters: `full_state_dict` (in memory) and `export` (streamed).

Both gather one unit at a time, so the peak is one unit's full parameters plus what is returned.
Keys and order are those of the original `model.state_dict()`; a tied parameter appears under each
of its names, as PyTorch gives it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from outcore.runtime.safetensors_stream import SafetensorsWriter

if TYPE_CHECKING:
    from outcore.runtime.sharded_model import ShardedModel


def _unit_tensors(sm: ShardedModel):
    """(state-dict name, CPU tensor) for every parameter, one unit gathered at a time."""
    for u in sm.units:
        full = u.full_values()
        for slot, off in zip(u.plan.slots, u.layout.offsets, strict=True):
            value = full[off : off + slot.numel].view(slot.shape).to("cpu", copy=True)
            for name in slot.state_dict_names:
                yield name, value
        del full


def _buffers(sm: ShardedModel) -> dict[str, torch.Tensor]:
    # Parameters are plain attributes now, so the module's own state_dict holds just its buffers.
    return {k: v.detach().cpu() for k, v in sm.model.state_dict().items()}


def full_state_dict(sm: ShardedModel) -> dict[str, torch.Tensor]:
    sm.settle()
    values = dict(_unit_tensors(sm))
    values.update(_buffers(sm))
    missing = [k for k in sm.state_dict_keys if k not in values]
    assert not missing, f"state dict keys not produced: {missing[:5]}"
    return {k: values[k] for k in sm.state_dict_keys}


def export_safetensors(sm: ShardedModel, path: str) -> None:
    """Stream every parameter and buffer into one safetensors file (rank 0 writes; all ranks gather)."""
    sm.settle()
    shapes = {}
    for u in sm.units:
        for slot in u.plan.slots:
            for name in slot.state_dict_names:
                shapes[name] = (u.dtype, tuple(slot.shape))
    buffers = _buffers(sm)
    for name, b in buffers.items():
        shapes[name] = (b.dtype, tuple(b.shape))
    writer = None
    if sm.group.rank == 0:
        writer = SafetensorsWriter(path, [(k, *shapes[k]) for k in sm.state_dict_keys],
                                   metadata={"format": "pt", "producer": "outcore"})
    for name, value in _unit_tensors(sm):
        if writer is not None:
            writer.write(name, value)
    if writer is not None:
        for name, b in buffers.items():
            writer.write(name, b)
        writer.close()
