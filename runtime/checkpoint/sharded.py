"""Sharded, checksummed, atomic checkpoints.

    <dir>/<tag>/rank<R>.safetensors   this rank's [master | exp_avg | exp_avg_sq] per chunk (fp32),
                                      whichever way the engine keeps them (runtime/optimizer.py)
    <dir>/<tag>/meta.json             config, world size, step, unit layout, crc32 of every rank file
    <dir>/latest                      the newest complete tag

Every rank writes into a folder of this save's own (`<dir>/.<tag>.<pid>-<random>.tmp/`),
streaming one unit at a time from wherever its state rests (NVMe included). Rank 0 then writes
meta.json and renames the folder into place, and only after that updates `latest`: a crash at any
instant leaves the previous checkpoint whole. Who may save where: runtime/checkpoint/guard.py.
Loading checks the layout and the crc32 of each file it reads before reading a byte of it into the
engine, and reads with safetensors (no unpickling). A checkpoint written by N ranks loads on M.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from typing import TYPE_CHECKING, Any

import torch

from outcore.offload import StorageError, Tier, TieredStore
from outcore.runtime.checkpoint.folder import (
    FORMAT,
    LATEST,
    find_checkpoint,
    is_tag,
    read_meta,
    sealed,
    verify_rank_file,
)
from outcore.runtime.checkpoint.guard import (
    refuse_a_file_in_the_way,
    refuse_scratch_inside,
    refuse_what_is_not_ours,
    sweep_dead_saves,
)
from outcore.runtime.checkpoint.layout_record import read_files, unit_layouts
from outcore.runtime.checkpoint.shards import EXP_AVG, EXP_AVG_SQ, MASTER, CheckpointShards
from outcore.runtime.collectives import barrier, gather_objects
from outcore.runtime.formats.safetensors_stream import SafetensorsWriter, file_crc32
from outcore.runtime.formats.written_files import create_file, unique_name
from outcore.runtime.frozen_in_place import checksums
from outcore.runtime.optimizer import ParamWriter

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from outcore.runtime.checkpoint.sharded_model import ShardedModel

BUFFER_PREFIX = "buffer."  # model buffers (running statistics and the like) ride in every rank's file
ROUNDING_STATE = "rounding.generator"  # bf16 states: the rank's stochastic-rounding generator


def _converting(folder: str, saved: str, ours: str) -> torch.dtype:
    """The dtype the engine stores optimizer states in; a checkpoint whose states were kept in the
    other one is converted as it loads, and the log says so."""
    if saved != ours:
        how = "widened exactly" if ours == "fp32" else "rounded to the nearest bf16"
        log.warning("checkpoint %s kept its optimizer states in %s and this engine keeps them in %s: %s as they "
                    "load", folder, saved, ours, how)
    return torch.bfloat16 if ours == "bf16" else torch.float32


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(sm: ShardedModel, directory: str, tag: str, progress: dict) -> str:
    """Write the model's training state under `directory/tag`; every rank calls it. `progress`:
    the engine's own counters for meta.json (step, lr, loss_scale, config). A save that fails (a full
    disk, say) removes what it wrote and leaves the previous checkpoints as they were."""
    if not is_tag(tag) or tag == LATEST:
        raise ValueError(f"checkpoint tag {tag!r}: use a plain name such as 'step100'.")
    client_state = {} if progress.get("client_state") is None else progress["client_state"]
    _check_client_state(client_state)
    refuse_a_file_in_the_way(directory)
    refuse_what_is_not_ours(directory, tag)
    refuse_scratch_inside(directory, sm.store.directory)
    sm.settle()
    final = os.path.join(directory, tag)
    tmp = _begin(sm, directory, tag)
    name = f"rank{sm.group.rank}.safetensors"
    path = os.path.join(tmp, name)
    try:
        _write_rank_file(sm, path)
        crcs = gather_objects((name, f"{file_crc32(path):08x}"), sm.group)
        if sm.group.rank == 0:
            meta = {"format": FORMAT, "tag": tag, "step": progress["step"], "world_size": sm.group.world,
                    "lr": progress["lr"], "lr_scheduler": progress.get("lr_scheduler"),
                    "loss_scale": progress["loss_scale"], "config": progress["config"],
                    "speculating": progress.get("speculating"),
                    "units": unit_layouts(sm), **sm.updates.counts.state_dict(),
                    "state_dict_keys": sm.state_dict_keys, **progress.get("model_record", {}),
                    "state_dtype": sm.store_state_dtype,
                    "client_state": client_state, "files": dict(crcs)}
            read = read_files(sm)
            if read:
                meta["weights_files"] = checksums(read)
            if sm.base is not None:
                meta["weights_source"] = sm.base.record()
            _publish(directory, tag, tmp, meta)
    except BaseException as e:
        if sm.group.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            _unlink(path)
        if isinstance(e, OSError):
            todo = "free space there, or" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "mend that, or"
            raise StorageError(f"checkpoint {final!r}: writing {e.filename or path!r} failed: {e.strerror}. The "
                               f"partial save was removed and the earlier checkpoints are as they were; {todo} "
                               "save to another directory.") from e
        raise
    barrier(sm.group)
    return final


def _begin(sm: ShardedModel, directory: str, tag: str) -> str:
    """Rank 0 takes the directory's lock, clears dead saves' leftovers and makes this save's own
    folder (runtime/checkpoint/guard.py); every rank learns its name, or rank 0's error."""
    tmp, error = "", None
    if sm.group.rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            sm.writer_lock.hold(directory)
            sweep_dead_saves(directory)
            tmp = unique_name(os.path.join(directory, tag))
            os.mkdir(tmp)  # exclusively: the name is this save's alone
        except (OSError, StorageError) as e:
            error = e
    shared, failed = gather_objects((tmp, None if error is None else str(error)), sm.group)[0]
    if error is not None:
        raise error
    if failed is not None:
        raise StorageError(f"rank 0 could not start the save: {failed}")
    return shared


def _write_rank_file(sm: ShardedModel, path: str) -> None:
    """This rank's states, streamed one unit at a time from wherever they rest."""
    store, place = sm.store, sm.place
    chunks = [c for u in sm.units for c in u.chunks]
    buffers = {BUFFER_PREFIX + k: v.contiguous() for k, v in sm.buffers().items()}
    # the others: meta.json says where they lie, or how they were quantized from the base
    frozen = [u for u in sm.units if u.frozen and u.in_place is None and u.quantized is None]
    rounding = sm.updates.rounding
    extra = {ROUNDING_STATE: rounding.state()} if rounding is not None else {}
    # Always fp32 [master|m|v]: one layout for export and resharding to read; bf16 states widen exactly.
    writer = SafetensorsWriter(path, [(c.opt_key, torch.float32, (3 * c.numel,)) for c in chunks]
                               + [(u.param_key, u.dtype, (u.layout.shard,)) for u in frozen]
                               + [(k, v.dtype, tuple(v.shape)) for k, v in {**buffers, **extra}.items()])
    for u in frozen:  # parameters only: no optimizer state (runtime/units.py [Note: frozen units])
        if u.aliased:
            writer.write(u.param_key, u.flat.detach())
            continue
        shard = store.fetch_now(u.param_key, store.ram_tier_of(u.param_key) or place.work_tier)
        try:
            writer.write(u.param_key, shard)
        finally:
            store.release(u.param_key)
    for u in (u for u in sm.units if u.chunks):  # (a frozen unit has no optimizer state)
        # fp32: the master is the parameter shard, and the state holds [m|v] after it.
        lent = u.master_is_param and not u.aliased
        master: torch.Tensor | None = None
        if u.master_is_param:
            master = store.fetch_now(u.param_key, place.work_tier) if lent else u.flat.detach()
        try:
            for c in u.chunks:
                state = store.fetch_now(c.opt_key, place.work_tier)
                try:
                    if master is None:
                        writer.write(c.opt_key, state.float())
                    else:
                        writer.write_part(c.opt_key, master[c.start : c.end].float(), 0)
                        writer.write_part(c.opt_key, state.float(), c.numel)
                finally:
                    store.release(c.opt_key)
        finally:
            if lent:
                store.release(u.param_key)
    for k, v in {**buffers, **extra}.items():
        writer.write(k, v)
    writer.close()


def _check_client_state(state: Any) -> None:
    """Before anything is written: the caller's state goes into meta.json, so JSON values only."""
    if not isinstance(state, dict):
        raise ValueError(f"client_state is a {type(state).__name__}; pass a dict of JSON values.")
    try:
        json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"client_state holds what JSON cannot ({e}); keep numbers, strings, lists and dicts "
                         "there, and save tensors or other objects yourself.") from None


def _publish(directory: str, tag: str, tmp: str, meta: dict) -> None:
    """Rank 0: meta.json into the finished folder, the folder into place, then `latest`. A tag saved
    before is moved aside to `.<tag>.old` first, and back should the move of the new one fail; a
    crash between the two leaves `.<tag>.old`, which loading takes for the tag
    (runtime/checkpoint/folder.py)."""
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(sealed(meta), f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    final, old = os.path.join(directory, tag), os.path.join(directory, f".{tag}.old")
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(old) and not os.path.exists(final):
            os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)
    latest_tmp = unique_name(os.path.join(directory, LATEST))
    try:
        fd = create_file(latest_tmp)
        with os.fdopen(fd, "w") as f:
            f.write(tag + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, os.path.join(directory, LATEST))
    finally:
        _unlink(latest_tmp)
    _fsync_dir(directory)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _overwrite(store: TieredStore, key: str, values: torch.Tensor, tier: Tier, *, return_home: bool) -> None:
    """`key` := `values`: in place where it rests in memory (a budget sized for one copy of the
    states has no room for a second while loading over a trained engine), else a new put."""
    ram = store.ram_tier_of(key)
    if ram is None:
        store.put(key, values, tier, return_home=return_home)
        return
    store.fetch_now(key, ram).copy_(values)
    store.release(key, dirty=True)


def _fits(layout: list[dict]) -> list[dict]:
    """The part of a unit layout that does not depend on the world size (nor on where the base lies)."""
    def how(quantized: Any) -> dict | bool:
        return {k: quantized[k] for k in ("kind", "double", "weights")} if isinstance(quantized, dict) else False

    return [{**{k: u.get(k, False) for k in ("name", "numel", "frozen", "params")},
             "quantized": how(u.get("quantized"))} for u in layout]


def _named(param: dict) -> str:
    first, *tied = param["names"]
    return f"{first} (tied to {', '.join(tied)})" if tied else first


def _first_difference(saved: list[dict], built: list[dict]) -> str:
    """Where two unit layouts (`_fits`) part, in words: the user's guide to what changed."""
    saved_names, built_names = [u["name"] for u in saved], [u["name"] for u in built]
    missing = [n for n in saved_names if n not in built_names]
    extra = [n for n in built_names if n not in saved_names]
    if missing and extra:  # e.g. a unit frozen on one side only: its name says "(frozen)"
        return f"the checkpoint's unit {missing[0]!r} is not in this model, which has {extra[0]!r}"
    if missing:
        return f"the checkpoint's unit {missing[0]!r} is not in this model"
    if extra:
        return f"this model's unit {extra[0]!r} is not in the checkpoint"
    if saved_names != built_names:
        return "the units come in another order"
    for s, b in zip(saved, built, strict=True):
        name = s["name"]
        if s["quantized"] != b["quantized"]:
            return (f"unit {name!r} rests quantized as {s['quantized'] or 'not quantized'} in the checkpoint and "
                    f"{b['quantized'] or 'not quantized'} in this engine (give the run's Config.quantize)")
        sps, bps = s["params"] or [], b["params"] or []  # a layout may have no parameter list: False
        for sp, bp in zip(sps, bps, strict=False):
            if sp["names"] != bp["names"]:
                return f"the checkpoint has {_named(sp)} where this model has {_named(bp)}"
            if sp["shape"] != bp["shape"]:
                return f"{sp['names'][0]} is {sp['shape']} in the checkpoint and {bp['shape']} in this model"
            if sp != bp:
                return f"{sp['names'][0]} sits at offset {sp.get('offset')} of its unit in the checkpoint, " \
                       f"{bp.get('offset')} in this model"
        if len(sps) != len(bps):
            return f"unit {name!r} holds {len(sps)} parameters in the checkpoint, {len(bps)} in this model"
        if s["numel"] != b["numel"]:
            return f"unit {name!r} holds {s['numel']:,} elements in the checkpoint, {b['numel']:,} in this model"
    return "the unit layouts differ"


def _moved_base(meta: dict, moved: dict[str, str]) -> None:
    """meta.json's references to the base's files, pointed at where they lie now (`moved`: old path
    to new, of files found to hold the same bytes)."""
    if not moved:
        return
    log.info("the base the checkpoint refers to moved to %s; its frozen units are read from there",
             os.path.dirname(next(iter(moved.values()))))
    for unit in meta["units"]:
        for entry in unit.get("in_place") or ():
            entry["file"] = moved.get(entry["file"], entry["file"])
    meta["weights_files"] = {moved.get(f, f): v for f, v in (meta.get("weights_files") or {}).items()}


def load_checkpoint(sm: ShardedModel, directory: str, tag: str | None = None) -> dict:
    """Restore the model states of a checkpoint written by `save_checkpoint` exactly, on any number
    of ranks (each reads its own new shard from whichever rank files hold it; see
    runtime/checkpoint/shards.py); every rank calls it. Returns its meta.json, whose step, lr and
    loss scale the engine restores itself. It also mends an engine whose update failed: every state
    is the checkpoint's afterwards."""
    sm.updates.abandon()
    folder = find_checkpoint(directory, tag)
    meta = read_meta(folder)
    if sm.base is not None and "weights_source" in meta:
        _moved_base(meta, sm.base.moved_from(meta["weights_source"], f"checkpoint {folder!r}"))
    saved, built = _fits(meta.get("units") or []), _fits(unit_layouts(sm))
    if saved != built:
        raise ValueError(f"checkpoint {folder!r} was written for a different model or unit split: "
                         f"{_first_difference(saved, built)}. Build the model as it was when saved (its "
                         "config, LoRA rank and frozen parameters) with the same unit_classes.")
    shards = CheckpointShards(folder, meta, verify=lambda name: verify_rank_file(folder, meta, name))
    state_dtype = _converting(folder, meta.get("state_dtype", "fp32"), sm.store_state_dtype)
    store, place, rank = sm.store, sm.place, sm.group.rank
    shards.open_for([(u.index, rank * u.layout.shard, (rank + 1) * u.layout.shard) for u in sm.units])
    try:
        with ParamWriter(store, place, in_place=False) as params:
            for u in sm.units:
                base = rank * u.layout.shard
                spans = shards.in_place(u.index) if u.frozen else None
                if u.quantized is not None:
                    pass  # the codes this engine derived from the base (checked to be the run's) stand
                elif spans is not None and not u.aliased:  # read where the weights lie, as the checkpoint's run did
                    store.put_source(u.param_key, spans.source(base, base + u.layout.shard), u.dtype)
                elif u.frozen:
                    values = shards.params(u.index, base, base + u.layout.shard).to(u.dtype)
                    if u.aliased:  # the stored shard is the live flat buffer
                        with torch.no_grad():
                            u.flat.copy_(values)
                    else:
                        store.put(u.param_key, values, place.param_tier)
                u.in_place = None if u.aliased else spans
                for c in u.chunks:
                    master, m, v = (shards.state(u.index, base + c.start, base + c.end, part)
                                    for part in (MASTER, EXP_AVG, EXP_AVG_SQ))
                    state = torch.cat([m, v] if u.master_is_param else [master, m, v]).to(state_dtype)
                    _overwrite(store, c.opt_key, state, place.opt_home(c.unit.index),
                               return_home=place.opt_returns_home(c.unit.index))
                    params.write(c, master)
                if u.resident:
                    u.refresh()
        buffers = shards.buffers(BUFFER_PREFIX)
        if sm.updates.rounding is not None and meta["world_size"] == sm.group.world:
            drawn = shards.of_rank(rank, ROUNDING_STATE)  # the draws go on where the saved run's would have
            if drawn is not None:
                sm.updates.rounding.load_state(drawn)
        shards.close()
        if buffers:
            with sm.guard.open():
                sm.model.load_state_dict(buffers, strict=False)
    except BaseException as e:
        sm.updates.loaded(e)  # some states are the checkpoint's, some not: the engine refuses to go on
        raise
    sm.updates.counts.load_state_dict(meta)
    sm.updates.loaded(None)
    meta.setdefault("client_state", {})  # written before save_checkpoint took one
    return meta
