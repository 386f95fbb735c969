"""`outcore export CKPT OUT.safetensors`: one consolidated file from a sharded checkpoint, offline.

No model and no engine: meta.json says where every parameter sits in its unit's flat buffer, and
each rank file holds that rank's [master | m | v] chunks. Each parameter is assembled from the
chunks that overlap it (read through safetensors slices, so only its bytes are read) and written
before the next one is read: memory is bounded by the largest single parameter.
"""

from __future__ import annotations

import json
import os

import torch

from outcore.hf.adapter_merge import AdapterMerge
from outcore.offload import StorageCorruptError
from outcore.runtime.checkpoint.base_files import protected_paths
from outcore.runtime.checkpoint.folder import find_checkpoint, read_meta, verify_rank_file
from outcore.runtime.checkpoint.sharded import BUFFER_PREFIX
from outcore.runtime.checkpoint.shards import CheckpointShards
from outcore.runtime.formats.export_target import check_export_path, export_target, is_one_file
from outcore.runtime.formats.safetensors_stream import SafetensorsWriter, ShardedSafetensorsWriter
from outcore.runtime.policy import DTYPES, torch_dtype


def checkpoint_folder(path: str, tag: str | None = None) -> str:
    """A checkpoint tag folder, or a checkpoint directory (its `latest`, or `tag`)."""
    if tag is None and os.path.exists(os.path.join(path, "meta.json")):
        return path
    return find_checkpoint(path, tag)


def read_export_meta(folder: str, *, verify: bool = True) -> dict:
    """meta.json, checked to carry parameter layouts, with every rank file present (and verified)."""
    meta = read_meta(folder)
    if "state_dict_keys" not in meta or any("params" not in u for u in meta["units"]):
        raise ValueError(f"checkpoint {folder!r} predates parameter layouts in meta.json; export it from a "
                         "running engine with engine.export(path) instead.")
    for name in meta["files"]:
        verify_rank_file(folder, meta, name, checksum=verify)
    return meta


def export_checkpoint(path: str, out: str, *, tag: str | None = None, dtype: str | None = None,
                      verify: bool = True, max_shard_size: int = 5_000_000_000, merge_adapters: bool = False,
                      tokenizer: str | None = None) -> dict:
    """Write every parameter and buffer of the checkpoint at `path` into one safetensors file (`out`
    ending in `.safetensors`), or into a Hugging Face directory: shards of at most `max_shard_size`
    bytes, their index, and config.json (with generation_config.json for a model that generates)
    when the run's model carried a Hugging Face config (tied weights stored once, under their first
    name, as `save_pretrained` does).

    `dtype`: of the parameters ("fp32" keeps the masters exact); default the run's compute dtype.
    `merge_adapters`: a LoRA run's base model with the adapters merged in, as meta.json records the
    merge (hf/adapter_merge.py); each merged tensor is computed in `dtype` from its parts.
    A directory gets the tokenizer too: from `tokenizer`, else from the model directory the run
    came from, as meta.json records it ("hf_source"); the result says which, or why none.
    The output appears whole or not at all (runtime/formats/export_target.py); other files in an existing
    directory are kept."""
    check_export_path(out)
    folder = checkpoint_folder(path, tag)
    meta = read_export_meta(folder, verify=verify)
    check_export_path(out, protected_paths(meta) + ([os.path.join(meta["hf_source"], "config.json")]
                                                    if meta.get("hf_source") else []))
    dtype = dtype or meta["config"].get("dtype", "fp32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}.")
    where = {}
    for index, unit in enumerate(meta["units"]):
        for param in unit["params"]:
            for name in param["names"]:
                where[name] = (index, param)
    shards = CheckpointShards(folder, meta)
    buffers = shards.buffers(BUFFER_PREFIX)
    one_file = is_one_file(out)
    merge = _recorded_merge(folder, meta) if merge_adapters else None
    if merge is None and not one_file and _has_adapters(meta):
        raise ValueError(f"checkpoint {folder!r} is of a LoRA (peft) model: a Hugging Face directory of it would "
                         "hold peft's names, which transformers does not load. Add --merge-adapters for the model "
                         "with its adapters merged in, or export a .safetensors file of every tensor, or take the "
                         "adapters `outcore train --lora` wrote (OUT/adapters).")
    names = merge.renamed if merge is not None else {k: k for k in meta["state_dict_keys"]}
    aliases = {n for unit in meta["units"] for param in unit["params"] for n in param["names"][1:]}
    if merge is not None:
        for unit in meta["units"]:
            for param in unit["params"]:
                merge.refuse_untying(param["names"])
    entries, sources = [], []
    for key in meta["state_dict_keys"]:
        if key not in names or (not one_file and key in aliases):
            continue
        if key in where:
            entries.append((names[key], torch_dtype(dtype), tuple(where[key][1]["shape"])))
        elif key in buffers:
            entries.append((names[key], buffers[key].dtype, tuple(buffers[key].shape)))
        else:
            raise StorageCorruptError(key, folder, "a state-dict key with neither a parameter layout nor a buffer")
        sources.append(key)
    metadata = {"format": "pt", "producer": "outcore export", "step": str(meta["step"])}
    largest = 0
    with export_target(out) as tmp:
        writer = (SafetensorsWriter(tmp, entries, metadata=metadata) if one_file
                  else ShardedSafetensorsWriter(tmp, entries, max_shard_size, metadata))
        try:
            last_param, last_value = None, None
            for (name, _, _), key in zip(entries, sources, strict=True):
                if key in where:
                    unit_index, param = where[key]
                    if last_value is None or last_param is not param:  # tied names share one assembled tensor
                        last_param, last_value = param, shards.parameter(unit_index, param)
                    value = last_value.to(torch_dtype(dtype))
                    largest = max(largest, last_value.numel() * 4)
                    if merge is not None and merge.changes(key):
                        value = merge.merged(key, _merge_parts(key, value, merge, where, shards, dtype))
                else:
                    value = buffers[key]
                writer.write(name, value)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        tokenizer_from = None
        if not one_file:
            for key, name in (("hf_config", "config.json"), ("hf_generation_config", "generation_config.json")):
                if meta.get(key):
                    with open(os.path.join(tmp, name), "w") as f:
                        json.dump(meta[key], f, indent=2)
            tokenizer_from = _tokenizer_into(tmp, tokenizer or meta.get("hf_source"), given=tokenizer is not None)
        size = os.path.getsize(tmp) if one_file else sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
    return {"checkpoint": folder, "out": out, "step": meta["step"], "tensors": len(entries), "dtype": dtype,
            "bytes": size, "largest_parameter_bytes": largest, "tokenizer_from": tokenizer_from}


def _tokenizer_into(directory: str, source: str | None, *, given: bool) -> str | None:
    """The tokenizer of `source` saved into `directory`; `source`, or None where there is none."""
    from outcore.hf.source import copy_tokenizer

    if source is None or not os.path.isdir(source):
        if given:
            raise ValueError(f"--tokenizer {source!r}: no such directory.")
        return None
    if copy_tokenizer(source, directory):
        return source
    if given:
        raise ValueError(f"--tokenizer {source!r} holds no tokenizer transformers loads.")
    return None


def _has_adapters(meta: dict) -> bool:
    """Whether the checkpoint's model is a peft LoRA model (a linear layer's or an embedding's factors)."""
    return any(".lora_A." in k or ".lora_embedding_A." in k for k in meta["state_dict_keys"])


def _recorded_merge(folder: str, meta: dict) -> AdapterMerge:
    record = meta.get("adapter_merge")
    if record is None:
        raise ValueError(f"--merge-adapters: checkpoint {folder!r} " + (
            "was written before outcore recorded how its adapters merge; resume the run and save again, or "
            "merge from a running engine with engine.export(dir, merge_adapters=True)." if _has_adapters(meta)
            else "is not of a LoRA (peft) model, so it has no adapters to merge; export it without the flag."))
    if "refused" in record:
        raise ValueError(f"--merge-adapters: checkpoint {folder!r}: {record['refused']}")
    return AdapterMerge.from_dict(record)


def _merge_parts(key: str, value: torch.Tensor, merge: AdapterMerge, where: dict, shards: CheckpointShards,
                 dtype: str) -> dict[str, torch.Tensor]:
    """The base tensor `key` (`value`) and the adapter tensors its merge reads, each in `dtype`, as
    the engine's own export merges compute-dtype values."""
    parts = {key: value}
    for name in merge.inputs(key):
        parts[name] = shards.parameter(*where[name]).to(torch_dtype(dtype))
    return parts
