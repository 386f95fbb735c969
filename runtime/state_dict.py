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
    from outcore.runtime.engine import Engine


def _unit_tensors(engine: Engine):
    """(state-dict name, CPU tensor) for every parameter, one unit gathered at a time."""
    for u in engine.units:
        full = u.full_values()
        for slot, off in zip(u.plan.slots, u.layout.offsets, strict=True):
            value = full[off : off + slot.numel].view(slot.shape).to("cpu", copy=True)
            for name in slot.state_dict_names:
                yield name, value
        del full


def _buffers(engine: Engine) -> dict[str, torch.Tensor]:
    # Parameters are plain attributes now, so the module's own state_dict holds just its buffers.
    return {k: v.detach().cpu() for k, v in engine.model.state_dict().items()}


def full_state_dict(engine: Engine) -> dict[str, torch.Tensor]:
    engine._wait_updates()
    values = dict(_unit_tensors(engine))
    values.update(_buffers(engine))
    missing = [k for k in engine._state_dict_keys if k not in values]
    assert not missing, f"state dict keys not produced: {missing[:5]}"
    return {k: values[k] for k in engine._state_dict_keys}


def export_safetensors(engine: Engine, path: str) -> None:
    """Stream every parameter and buffer into one safetensors file (rank 0 writes; all ranks gather)."""
    engine._wait_updates()
    shapes = {}
    for u in engine.units:
        for slot in u.plan.slots:
            for name in slot.state_dict_names:
                shapes[name] = (u.dtype, tuple(slot.shape))
    buffers = _buffers(engine)
    for name, b in buffers.items():
        shapes[name] = (b.dtype, tuple(b.shape))
    writer = None
    if engine.group.rank == 0:
        writer = SafetensorsWriter(path, [(k, *shapes[k]) for k in engine._state_dict_keys],
                                   metadata={"format": "pt", "producer": "outcore"})
    for name, value in _unit_tensors(engine):
        if writer is not None:
            writer.write(name, value)
    if writer is not None:
        for name, b in buffers.items():
            writer.write(name, b)
        writer.close()
