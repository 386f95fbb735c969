"""Whole-model views of sharded parameters: `full_state_dict` (in memory) and `export` (streamed).

Both gather one unit at a time, so the peak is one unit's full parameters plus what is returned.
Keys and order are those of the original `model.state_dict()`; a tied parameter appears under each
of its names, as PyTorch gives it, except in a Hugging Face directory, which stores it once (under
its first name) and lets the config tie it again on load.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING

import torch

from outcore.runtime.flat_unit import FlatUnit
from outcore.runtime.formats.export_target import check_export_path, export_target, is_one_file
from outcore.runtime.formats.safetensors_stream import SafetensorsWriter, ShardedSafetensorsWriter
from outcore.runtime.model_family import TensorMerge

if TYPE_CHECKING:
    from outcore.runtime.checkpoint.sharded_model import ShardedModel

log = logging.getLogger(__name__)


def _unit_tensors(sm: ShardedModel, units: list[FlatUnit] | None = None, *,
                  copy: bool = True, exported: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(state-dict name, CPU tensor) for every parameter, one unit gathered at a time. Without
    `copy`, on CPU, the tensors are views of the unit's gathered buffer (a new one, which
    `full_values` gives): for a caller that is done with them before it asks for the next unit.
    `exported`: what an export writes (`FlatUnit.exported_values`: a quantized base's originals)."""
    for u in sm.units if units is None else units:
        full = u.exported_values() if exported else u.full_values()
        for slot, off in zip(u.plan.slots, u.layout.offsets, strict=True):
            value = full[off : off + slot.numel].view(slot.shape).to("cpu", copy=copy)
            for name in slot.state_dict_names:
                yield name, value
        del full


def full_state_dict(sm: ShardedModel) -> dict[str, torch.Tensor]:
    sm.settle()
    values = dict(_unit_tensors(sm))
    values.update(sm.buffers())
    missing = [k for k in sm.state_dict_keys if k not in values]
    assert not missing, f"state dict keys not produced: {missing[:5]}"
    return {k: values[k] for k in sm.state_dict_keys}


def export_model(sm: ShardedModel, path: str, *, adapters_only: bool, merge_adapters: bool,
                 max_shard_size: int) -> None:
    """`Engine.export`: the adapters alone, the model with its adapters merged in, or the model."""
    if adapters_only and merge_adapters:
        raise ValueError("export: adapters_only writes the adapters alone and merge_adapters merges them into "
                         "the base model; ask for one of them.")
    if adapters_only:
        export_adapters(sm, path)
        return
    merge = None
    if merge_adapters:
        if not sm.family.has_adapters():
            raise ValueError(f"export({path!r}, merge_adapters=True): this {type(sm.model).__name__} is not a "
                             "peft model, so it has no adapters to merge; export it as it is.")
        merge = sm.family.adapter_merge(sm.state_dict_keys)
    export(sm, path, max_shard_size=max_shard_size, save_config=sm.family.config_writer(), merge=merge)


def protected_files(sm: ShardedModel) -> list[str]:
    """The files an export must not replace: the base the engine started from, and those its frozen
    units are read from (a checkpoint's, after a load)."""
    read = {f for u in sm.units if u.in_place is not None for f in u.in_place.stamps}
    return sorted(read | set(sm.base.stamps if sm.base is not None else ()))


def export(sm: ShardedModel, path: str, *, max_shard_size: int, save_config: Callable[[str], None] | None,
           merge: TensorMerge | None = None) -> None:
    """Stream every parameter and buffer into `path`: one safetensors file when it ends in
    `.safetensors`, else a Hugging Face directory (shards, index, and `save_config(path)` writing
    config.json); written aside and moved into place, keeping other files of an existing directory
    (runtime/formats/export_target.py). With `merge`, a peft model's adapters are merged into the base
    model's tensors, which take its names (hf/adapter_merge.py). Rank 0 writes; every rank
    gathers."""
    one_file = is_one_file(path)
    if sm.family.has_adapters() and not one_file and merge is None:
        raise ValueError("a LoRA model's directory export is its adapters, export(dir, adapters_only=True), for "
                         "peft.PeftModel.from_pretrained on the base model; or its base model with the adapters "
                         "merged in, export(dir, merge_adapters=True), for from_pretrained alone.")
    check_export_path(path, protected_files(sm))
    sm.settle()
    rename = merge.renamed if merge is not None else {k: k for k in sm.state_dict_keys}
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    aliases: set[str] = set()  # tied names after the first: a Hugging Face directory stores them once
    for u in sm.units:
        for slot in u.plan.slots:
            if merge is not None:
                merge.refuse_untying(slot.state_dict_names)
            for name in slot.state_dict_names:
                if name in rename:
                    shapes[rename[name]] = (u.dtype, tuple(slot.shape))
            aliases.update(rename[n] for n in slot.state_dict_names[1:] if n in rename)
    buffers = {rename[k]: b for k, b in sm.buffers().items() if k in rename}
    for name, b in buffers.items():
        shapes[name] = (b.dtype, tuple(b.shape))
    keys = [rename[k] for k in sm.state_dict_keys if k in rename and (one_file or rename[k] not in aliases)]
    wanted = set(keys)
    with ExitStack() as rank0:
        writer: SafetensorsWriter | ShardedSafetensorsWriter | None = None
        if sm.group.rank == 0:
            target = rank0.enter_context(export_target(path))
            entries = [(k, *shapes[k]) for k in keys]
            metadata = {"format": "pt", "producer": "outcore"}
            writer = (SafetensorsWriter(target, entries, metadata) if one_file
                      else ShardedSafetensorsWriter(target, entries, max_shard_size, metadata))
            rank0.callback(writer.abort)
        tensors = _unit_tensors(sm, copy=False, exported=True) if merge is None else _merged_tensors(sm, merge)
        for name, value in tensors:
            if writer is not None and name in wanted:
                writer.write(name, value)
        if writer is not None:
            for name, b in buffers.items():
                if name in wanted:
                    writer.write(name, b)
            writer.close()
            if not one_file and save_config is not None:
                save_config(target)


def _merged_tensors(sm: ShardedModel, merge: TensorMerge) -> Iterator[tuple[str, torch.Tensor]]:
    """(base-model name, CPU tensor) with the adapters merged in, a unit and its frozen sibling
    gathered together: between them they hold a module's weight and its adapter's factors. Only a
    merged tensor is copied, so the peak is the two units once."""
    units = sm.units
    start = 0
    while start < len(units):
        end = start + 1
        while end < len(units) and units[end].plan.module is units[start].plan.module:
            end += 1
        tensors = dict(_unit_tensors(sm, units[start:end], copy=False, exported=True))
        for name in tensors:
            if name in merge.renamed:
                yield merge.renamed[name], merge.merged(name, tensors)
        del tensors
        start = end


def export_adapters(sm: ShardedModel, directory: str) -> None:
    """The model's adapters as its adapter library loads them (for peft: adapter_model.safetensors and
    adapter_config.json, which `peft.PeftModel.from_pretrained` reads). Only the trainable units
    are gathered; rank 0 writes."""
    from safetensors.torch import save_file

    if not sm.family.has_adapters():
        raise ValueError(f"export({directory!r}, adapters_only=True): this {type(sm.model).__name__} is not a "
                         "peft model, so it has no adapters; export it whole (adapters_only=False).")
    if is_one_file(directory):
        raise ValueError(f"export {directory!r}, adapters_only=True: adapters are a directory (what "
                         "PeftModel.from_pretrained loads); name one without the .safetensors suffix.")
    check_export_path(directory, protected_files(sm))
    sm.settle()
    adapters = dict(_unit_tensors(sm, [u for u in sm.units if not u.frozen]))
    if sm.group.rank != 0:
        return
    with sm.guard.open():  # (peft asks a module trained whole for its state_dict())
        state, write_config = sm.family.adapter_tensors(adapters)
    with export_target(directory) as target:
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(target, "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        write_config(target)
