"""An engine's start: its store, sized from the memory plan, and the model's parameters laid into it
unit by unit, as this rank's shards and their optimizer states.

`Engine.__init__` calls these in order: `open_store` (budgets, the kept optimizer states, the NVMe
space checked before a byte is written), then `lay_out_states` (buffers first, then each unit
materialized, flattened, cut to this rank's shard and put in the store, its module's own copies
dropped), and only then wires its hooks.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import psutil
import torch
from torch import nn

from outcore.offload import StorageFullError, Tier, TieredStore
from outcore.offload.file_source import FileSpan
from outcore.offload.owned_dir import OwnedDir
from outcore.offload.scratch_dir import prepare_directory, remove_made
from outcore.runtime.activation_paging import host_share
from outcore.runtime.checkpoint.sharded_model import AnchorParameter
from outcore.runtime.config import SEEDS, Config
from outcore.runtime.flat_unit import FlatUnit
from outcore.runtime.frozen_in_place import UnitSpans
from outcore.runtime.host_heap import mmap_threshold_for, pin_mmap_threshold
from outcore.runtime.materialize import materialize_unit, recompute_buffers
from outcore.runtime.memory_plan import UnitShape, plan_memory, unit_shapes
from outcore.runtime.model_family import ModelFamily
from outcore.runtime.optimizer import AdamW, initial_state
from outcore.runtime.policy import Placement, StatePolicy
from outcore.runtime.pretrained import PretrainedWeights
from outcore.runtime.quantized import QuantizedLayout
from outcore.runtime.quantized_base import stored_spans
from outcore.runtime.units import ParamSlot, UnitPlan, plan_layout

log = logging.getLogger(__name__)


def check_arguments(model: Any, config: Any, optimizer: Any, seed: Any) -> None:
    """The engine's arguments are of the kinds it takes; the usual mix-ups from DeepSpeed and
    plain PyTorch are each one TypeError saying what to pass instead."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"Engine(model, ...): the model given ({_kind(model)}) is not a torch.nn.Module.")
    if not isinstance(config, Config):
        raise TypeError(f"Engine(model, config): the config given ({_kind(config)}) is not an outcore.Config; "
                        "build one with outcore.Config(...), Config.from_dict(d), Config.from_file(path), or "
                        "Config.from_deepspeed(ds_config).")
    if optimizer is not None and not isinstance(optimizer, AdamW):
        raise TypeError(f"Engine(model, config, optimizer): the optimizer given ({_kind(optimizer)}) is not an "
                        "outcore.AdamW. The engine runs its own fused AdamW over the sharded states, so it takes "
                        "outcore.AdamW(lr=..., betas=..., eps=..., weight_decay=...) with the settings you want; "
                        "for a schedule pass lr_scheduler=lambda opt: <a torch LR scheduler on opt>, or set "
                        "engine.lr before each step.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"Engine(..., seed=...): the seed given ({_kind(seed)}) is not an int.")
    if seed not in SEEDS:
        raise ValueError(f"Engine(..., seed={seed}): a seed is a whole number from 0 to 2**32 - 1.")
    if any(isinstance(p, AnchorParameter) for p in model.parameters()):
        raise ValueError(f"this {type(model).__name__} is already wrapped by an outcore Engine: its parameters "
                         "are in that engine's store (gone with it once closed). Keep using that engine, or "
                         "build the model again; a saved run comes back with load_checkpoint, an export with "
                         "weights=.")


def check_pretrained(weights: str | None, family: ModelFamily, plans: list[UnitPlan]) -> PretrainedWeights | None:
    """The weights `weights` names (None: none), every name and shape checked against the units'
    parameters before anything is written; a directory's generation settings read."""
    if weights is None:
        return None
    pretrained = PretrainedWeights(weights, family)
    adapters = family.has_adapters()  # trainable parameters missing from the files are its adapters
    pretrained.check([s for p in plans for s in p.slots], new=lambda slot: adapters and not slot.frozen)
    if os.path.isdir(pretrained.path):
        family.read_settings(pretrained.path)
    return pretrained


def _kind(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def shapes_of(plans: list[UnitPlan], policy: StatePolicy,
              quantized: Sequence[QuantizedLayout | None] | None = None) -> list[UnitShape]:
    """The units' sizes as the memory plan counts them (a quantized unit's shard: its bytes)."""
    numels, layout = plan_layout(plans)
    stored = None if quantized is None else [None if q is None else q.shard for q in quantized]
    return unit_shapes(numels, policy, stored=stored, **layout)


def open_store(config: Config, policy: StatePolicy, device: torch.device, rank: int,
               shapes: list[UnitShape], *,
               frozen_in_files: bool) -> tuple[TieredStore, Placement, int, OwnedDir | None]:
    """The store, sized from the memory plan, the final placement (whether optimizer states on NVMe
    are written back after each update depends on the host budget), how many optimizer chunks an
    update reads ahead (so does that), and the scratch folder made for it where the config names
    no nvme_dir. `frozen_in_files`: frozen units are read from the weights files, not the swap file."""
    c = config
    plan = plan_memory(shapes, policy, frozen_in_files=frozen_in_files)
    device_budget, host_budget = plan.budgets(c.device_budget, c.host_budget, psutil.virtual_memory().available)
    if not policy.aliased:  # units gathered and freed every step: runtime/host_heap.py
        pin_mmap_threshold(mmap_threshold_for(host_budget + (device_budget if device.type == "cpu" else 0)))
    kept, read_ahead = plan.kept_units(host_budget), plan.read_ahead(host_budget)
    plan = plan.placed(kept)
    if c.host_budget is None:  # the states' budget, then room for activations asked to page
        host_budget += host_share(c.offload_activations, psutil.virtual_memory().available)
    if plan.nvme.total:  # the states that rest on NVMe must fit: refuse now, with both numbers
        assert c.nvme_dir is not None  # Config requires it with anything on NVMe
        usage = shutil.disk_usage(prepare_directory(c.nvme_dir))
        if usage.total == 0:  # ramfs and its kind report no size at all: nothing to check against
            log.warning("nvme_dir %s is on a filesystem that reports no size (ramfs?): the %s bytes meant for NVMe "
                        "are not checked against its room, and live in memory there", c.nvme_dir,
                        f"{plan.nvme.total:,}")
        elif usage.free < plan.nvme.total:
            raise StorageFullError(c.nvme_dir, plan.nvme.total, usage.free)
    # Optimizer states the host budget has room for rest there: runtime/memory_plan.py
    # [Note: kept optimizer states].
    place = replace(policy.placement, kept=kept)
    # Nothing rests on NVMe without an nvme_dir, but the store still wants a scratch folder.
    owned = OwnedDir("outcore-") if c.nvme_dir is None else None
    directory = owned.path if owned is not None else c.nvme_dir
    assert directory is not None
    try:
        store = TieredStore(directory, device, device_budget, host_budget, c.io, rank=rank,
                            prefetch_bytes=device_budget // 2)
    except BaseException:
        if owned is not None:
            owned.remove()
        raise
    return store, place, read_ahead, owned


def lay_out_states(family: ModelFamily, units: list[FlatUnit], store: TieredStore, place: Placement,
                   policy: StatePolicy, device: torch.device, rank: int, *,
                   init_fn: Callable[[nn.Module], None] | None, seed: int,
                   pretrained: PretrainedWeights | None) -> None:
    """Each unit's parameters, from `pretrained` or initialized, into the store as this rank's
    shard (the module's own copies are dropped). The buffers come first, onto the device: from
    `pretrained` where it holds them, else recomputed when built on the meta device."""
    model = family.model
    names = {m: n for n, m in model.named_modules(remove_duplicate=False)}
    later = family.computed_buffers()  # an adapter's initialization computes these from the weights
    for module, prefix in names.items():
        if module in later:
            continue
        full = {n: f"{prefix}.{n}" if prefix else n for n, b in module._buffers.items() if b is not None}
        stored = {n: pretrained.tensors[family.stored_name(f)] for n, f in full.items()
                  if pretrained is not None and family.stored_name(f) in pretrained.tensors}
        recompute_buffers(family, prefix, module, init_fn, keep=set(stored))
        for n in full:
            buf = module._buffers[n]
            assert buf is not None
            if pretrained is not None and n in stored:
                buf = pretrained.read(stored[n], buf.dtype).to(buf.dtype)
            module._buffers[n] = buf.to(device)
    in_units = {m for u in units if u.plan.module is not model for m in u.plan.module.modules()}
    loaded = pretrained.holds(names) if pretrained is not None else (lambda _m, _n: False)
    slot_at = {place: slot for u in units for slot in u.plan.slots for place in slot.places}
    read_in: set[ParamSlot] = set()  # base weights an adapter's initialization read into their module

    def read_base(module: nn.Module, name: str, changes: bool) -> torch.Tensor | None:
        slot = slot_at[(module, name)]
        tied = len(slot.places) > 1
        if tied and changes:
            raise ValueError(f"{names[module]}.{name} is tied to another parameter ({', '.join(slot.state_dict_names)}"
                             "): an adapter initialized from it would change only one of them. Leave it out of "
                             "target_modules, or initialize that adapter as peft does by default "
                             "(init_lora_weights=True).")
        stored = pretrained.find(slot) if pretrained is not None and slot not in read_in else None
        if pretrained is None or stored is None:
            return None
        if not tied:  # its unit takes it from the module; a tied one's other place reads the files again
            read_in.add(slot)
        return pretrained.read_parameter(slot, stored)

    heads = pretrained.head_initializers(names, seed) if pretrained is not None else {}
    copied: list[str] = []  # frozen units on NVMe copied into the swap file, and why
    for unit in units:
        materialize_unit(unit.plan, family, in_units, init_fn=init_fn, seed=seed, loaded=loaded,
                         read_base=read_base, initializers=heads)
        spans = None
        if pretrained is not None and unit.quantized is not None and _read_as_stored(unit, store, place, pretrained,
                                                                                     rank):
            _drop_module_parameters(unit, policy)
            continue
        if pretrained is not None and unit.quantized is not None:  # what an export writes of it
            unit.original = _in_place(unit, pretrained, read_in)[0]
        if (pretrained is not None and unit.frozen and place.param_tier == Tier.NVME and not unit.resident
                and unit.quantized is None):
            spans, why = _in_place(unit, pretrained, read_in)
            if spans is None:
                copied.append(f"{unit.name}: {why}")
        if spans is not None:
            unit.in_place = spans
            store.put_source(unit.param_key, spans.source(rank * unit.layout.shard, (rank + 1) * unit.layout.shard),
                             unit.dtype)
            _drop_module_parameters(unit, policy)
        else:
            _shard(unit, store, place, policy, rank, pretrained, read_in)
    if pretrained is not None:
        pretrained.close()
    if copied:
        log.warning("weights: %d frozen unit(s) are copied into the swap file instead of read where the weights lie "
                    "(%s%s)", len(copied), copied[0], f"; and {len(copied) - 1} more" if len(copied) > 1 else "")


def _read_as_stored(unit: FlatUnit, store: TieredStore, place: Placement, pretrained: PretrainedWeights,
                    rank: int) -> bool:
    """A quantized unit the files hold quantized (runtime/stored_quantized.py): on NVMe it rests on its
    spans of the files, nothing copied; in memory they are read there once. False where the files
    do not hold it so."""
    spans = stored_spans(unit, pretrained)
    if spans is None:
        return False
    q = unit.quantized
    assert q is not None
    source = spans.source(rank * q.shard, (rank + 1) * q.shard)
    if place.param_tier == Tier.NVME:
        unit.in_place = spans
        store.put_source(unit.param_key, source, torch.uint8)
    else:
        raw = torch.empty(q.shard, dtype=torch.uint8)
        source.read_into(raw)
        store.put(unit.param_key, raw, place.param_tier, return_home=place.param_returns_home)
    return True


def _in_place(unit: FlatUnit, pretrained: PretrainedWeights,
              read_in: set[ParamSlot]) -> tuple[UnitSpans | None, str]:
    """The spans of the weights files a frozen unit's flat buffer is, when every parameter is one
    stored tensor as stored; else None and why not."""
    spans = []
    for slot, off in zip(unit.plan.slots, unit.layout.offsets, strict=True):
        stored = pretrained.as_stored(slot)
        if slot in read_in:
            return None, f"{slot.state_dict_names[0]} was read by its adapter's initialization"
        if stored is None:
            return None, f"{slot.state_dict_names[0]} is not one tensor of the files as stored"
        assert stored.dtype is not None  # as_stored
        spans.append(FileSpan(stored.file, stored.begin, stored.dtype, slot.numel, off))
    return UnitSpans(tuple(spans), {s.path: pretrained.stamps[s.path] for s in spans}), ""


def _shard(unit: FlatUnit, store: TieredStore, place: Placement, policy: StatePolicy, rank: int,
           pretrained: PretrainedWeights | None, read_in: set[ParamSlot]) -> None:
    """Flatten the unit's parameters (read from `pretrained` where it has them and they were not
    `read_in` already, else their own values), keep this rank's shard, drop the originals."""
    lay = unit.layout

    def value(slot: ParamSlot, into: torch.Tensor | None = None) -> torch.Tensor:
        stored = pretrained.find(slot) if pretrained is not None and slot not in read_in else None
        if pretrained is not None and stored is not None:
            return pretrained.read_parameter(slot, stored, out=into)
        module, name = slot.places[0]
        param = module._parameters[name]
        assert param is not None and not param.is_meta
        return param.detach() if into is None else into.copy_(param.detach())

    if unit.quantized is not None:  # its codes and scales, a parameter read at a time: runtime/quantized.py
        q = unit.quantized
        raw = q.encode((value(slot) for slot in unit.plan.slots), unit.device)
        store.put(unit.param_key, raw[rank * q.shard : (rank + 1) * q.shard], place.param_tier,
                  return_home=place.param_returns_home)
        del raw
        _drop_module_parameters(unit, policy)
        return
    flat32 = torch.zeros(lay.padded, dtype=torch.float32)
    for slot, off in zip(unit.plan.slots, lay.offsets, strict=True):
        value(slot, flat32[off : off + slot.numel].view(slot.shape))
    master = flat32[rank * lay.shard : (rank + 1) * lay.shard]
    for c in unit.chunks:
        state = initial_state(master[c.start : c.end], with_master=not unit.master_is_param,
                              dtype=torch.bfloat16 if policy.state_dtype == "bf16" else torch.float32)
        store.put(c.opt_key, state, place.opt_home(unit.index), return_home=place.opt_returns_home(unit.index))
    store.put(unit.param_key, master, place.param_tier, dtype=unit.dtype, return_home=place.param_returns_home)
    del flat32, master
    _drop_module_parameters(unit, policy)


def _drop_module_parameters(unit: FlatUnit, policy: StatePolicy) -> None:
    """The unit's shard is in the store: its modules' own parameters go, the flat buffer's views
    take their place."""
    for slot in unit.plan.slots:
        for module, name in slot.places:
            del module._parameters[name]
        slot.param = None
    unit.release_views()
    if unit.resident:
        if policy.aliased:
            unit.alias_shard()
        else:
            unit.unshard()
        unit.bind_views()


def close_failed_start(close: Callable[[], None], nvme_dir: str | None) -> None:
    """After a start that failed: the engine closed (no swap file left filling the disk), and the
    folders made for `nvme_dir` removed where that leaves them empty."""
    try:
        close()
    except Exception:  # noqa: BLE001 - the error that stopped the start is the one to see
        log.warning("closing the store of an engine that failed to start also failed", exc_info=True)
    if nvme_dir is not None:
        remove_made(nvme_dir)
