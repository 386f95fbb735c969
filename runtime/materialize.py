"""Deferred initialization: models built on the meta device, materialized one unit at a time.

    with outcore.deferred_init():
        model = MyModel()          # no real memory: every tensor is on the meta device
    engine = outcore.Engine(model, config)   # each unit is materialized, sharded, then dropped

A module's parameters are initialized by `init_fn(module)` when given, else by its own
`reset_parameters()` (or come from `weights=`; see runtime/pretrained.py). Each unit draws from its
own seeded generator state, so initialization is reproducible and does not depend on the split.

Buffers computed in `__init__` (rotary tables, masks) are on the meta device too, without values.
The engine gives them values before anything else (`recompute_buffers`): from `weights=` when the
files hold them, else by running the module's initialization again with real buffers: `init_fn`,
a Hugging Face model's own `_init_weights` (which recomputes rotary tables), or
`reset_parameters()`. A buffer that none of these fills is an error naming it, never garbage.
(Building with parameters alone on the meta device, as Accelerate's
`init_empty_weights(include_buffers=False)` does, made peak RSS of the memory test vary between
0.64 and 1.1 GiB where this measures 0.63-0.66; see docs/benchmarks.md.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from outcore.runtime.units import UnitPlan


@contextlib.contextmanager
def deferred_init() -> Iterator[None]:
    """Build modules on the meta device: shapes and structure only, no memory."""
    with torch.device("meta"):
        yield


def meta_parameters(module: nn.Module) -> list[str]:
    """Names of `module`'s own parameters that have no values yet."""
    return [n for n, p in module._parameters.items() if p is not None and p.is_meta]


def _unit_modules(plan: UnitPlan, model: nn.Module, in_units: set[nn.Module]) -> list[nn.Module]:
    if plan.module is model:  # the root unit: every module that no block unit holds
        return [m for m in model.modules() if m not in in_units]
    return list(plan.module.modules())


def materialize_unit(plan: UnitPlan, model: nn.Module, in_units: set[nn.Module], *,
                     init_fn: Callable[[nn.Module], None] | None, seed: int,
                     loaded: Callable[[nn.Module, str], bool] = lambda _m, _n: False,
                     lora_init: object = True) -> None:
    """Give the unit's meta parameters real CPU memory and initialize them, except those `loaded`
    says come from pretrained weights (they stay on the meta device until read). Parameters that
    already hold values, and buffers, are left as they are.

    peft's LoRA layers are initialized as peft does it (`reset_lora_parameters`, with `lora_init`,
    the adapter config's `init_lora_weights`): A like a linear layer, B zero, so that the adapted
    model starts as the base model."""
    modules = _unit_modules(plan, model, in_units)
    lora_layers = [m for m in modules if init_fn is None and _is_lora_layer(m)]
    lora_dicts = {d for m in lora_layers for parts in _lora_parts(m).values() for d in parts
                  if isinstance(d, nn.ParameterDict)}
    fresh = []
    for m in modules:
        names = [n for n in meta_parameters(m) if not loaded(m, n)]
        for name in names:
            p = m._parameters[name]
            assert p is not None
            m._parameters[name] = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
        if names:
            fresh.append(m)
    if not fresh:
        return
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed * 1_000_003 + plan.index)
        for m in fresh:
            if init_fn is not None:
                init_fn(m)
            elif callable(reset := getattr(m, "reset_parameters", None)):
                reset()
            elif callable(reset := getattr(m, "_reset_parameters", None)):  # nn.MultiheadAttention
                reset()
            elif type(m).__module__.startswith("peft."):
                raise ValueError(f"{type(m).__name__}: peft computes this adapter part from the base weights as it "
                                 "wraps the model (DoRA's magnitude), and a model built under deferred_init() has "
                                 "none yet. Build the model with its weights (from_pretrained) before "
                                 "get_peft_model, or train plain LoRA (use_dora=False).")
            elif m in lora_dicts:  # an embedding's adapter factors: drawn as peft creates them (randn), then
                for p in m.parameters():  # its LoRA layer's reset below
                    nn.init.normal_(p)
            else:
                raise ValueError(f"{type(m).__name__} was built under deferred_init() but has no "
                                 "reset_parameters(); pass init_fn= to the Engine to initialize it, or "
                                 "weights= to load it.")
        for m in lora_layers:
            reset_lora = getattr(m, "reset_lora_parameters")  # noqa: B009 - a method mypy sees as a Tensor
            for adapter, parts in _lora_parts(m).items():
                if any(c in fresh for part in parts for c in part.modules()):
                    reset_lora(adapter, lora_init)


def _is_lora_layer(m: nn.Module) -> bool:
    return callable(getattr(m, "reset_lora_parameters", None)) and isinstance(getattr(m, "lora_A", None),
                                                                               nn.ModuleDict)


def _lora_parts(layer: nn.Module) -> dict[str, list[nn.Module]]:
    """A peft LoRA layer's adapters and the modules that hold their factors: `lora_A[adapter]` of a
    linear layer, the `lora_embedding_A/B` parameter dicts of an embedding."""
    parts: dict[str, list[nn.Module]] = {}
    for name in ("lora_A", "lora_embedding_A", "lora_embedding_B"):
        holder = getattr(layer, name, None)
        if isinstance(holder, nn.ModuleDict):
            for adapter, module in holder.items():
                parts.setdefault(adapter, []).append(module)
        elif isinstance(holder, nn.ParameterDict):
            for adapter in holder:
                parts.setdefault(adapter, []).append(holder)
    return parts


def recompute_buffers(model: nn.Module, name: str, module: nn.Module,
                      init_fn: Callable[[nn.Module], None] | None, keep: set[str]) -> None:
    """Give `module`'s meta buffers (except those in `keep`, which come from weights) real
    values by running its initialization again; ValueError naming a buffer left without values."""
    meta = [n for n, b in module._buffers.items() if b is not None and b.is_meta and n not in keep]
    if not meta:
        return
    for n in meta:
        buf = module._buffers[n]
        assert buf is not None
        module._buffers[n] = torch.full_like(buf, _sentinel(buf.dtype), device="cpu")
    hf_init: Callable[[nn.Module], None] | None = next(
        (getattr(m, "_init_weights") for m in model.modules()  # noqa: B009 - a Hugging Face model's method
         if callable(getattr(m, "_init_weights", None)) and hasattr(m, "config")), None)
    with torch.no_grad():
        if init_fn is not None:
            init_fn(module)
        elif hf_init is not None:
            hf_init(module)
        elif callable(reset := getattr(module, "reset_parameters", None)):
            reset()
    for n in meta:
        buf = module._buffers[n]
        assert buf is not None
        untouched = bool(torch.isnan(buf).any()) if buf.dtype.is_floating_point else bool(
            torch.all(buf == _sentinel(buf.dtype)))
        if untouched:
            full = f"{name}.{n}" if name else n
            raise ValueError(f"buffer {full!r} was built on the meta device and its module's initialization "
                             "does not compute it: give it in weights=, compute it in reset_parameters() or "
                             "init_fn, or build the model outside deferred_init().")


def _sentinel(dtype: torch.dtype) -> float | int | bool:
    """What a buffer holds before its initialization runs, to see whether it did."""
    if dtype.is_floating_point:
        return float("nan")
    return True if dtype == torch.bool else torch.iinfo(dtype).min
