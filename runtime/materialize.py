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
`init_empty_weights(include_buffers=False)` does, made the memory test's peak RSS vary from run
to run; see docs/benchmarks.md.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from outcore.runtime.model_family import ModelFamily, ReadBase
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


def _no_weights(_module: nn.Module, _name: str, _changes: bool) -> torch.Tensor | None:
    return None  # without weights=, every parameter holds its own initialized value


def materialize_unit(plan: UnitPlan, family: ModelFamily, in_units: set[nn.Module], *,
                     init_fn: Callable[[nn.Module], None] | None, seed: int,
                     loaded: Callable[[nn.Module, str], bool] = lambda _m, _n: False,
                     read_base: ReadBase = _no_weights,
                     initializers: dict[nn.Module, Callable[[nn.Module], None]] | None = None) -> None:
    """Give the unit's meta parameters real CPU memory and initialize them, except those `loaded`
    says come from pretrained weights (they stay on the meta device until read). Parameters that
    already hold values, and buffers, are left as they are.

    Adapters (peft's, for a Hugging Face model) are then initialized as their library does it
    (`family.initialize_adapters`); those computed from a base weight read it first with
    `read_base`. A module in `initializers` is initialized by its entry there (a task head new
    to the weights)."""
    model = family.model
    modules = _unit_modules(plan, model, in_units)
    tuner_layers = family.adapter_layers(modules) if init_fn is None else []
    adapter_dicts, computed_later = family.drawn_adapter_parts(tuner_layers)
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
            elif initializers and m in initializers:
                initializers[m](m)
            elif callable(reset := getattr(m, "reset_parameters", None)):
                reset()
            elif callable(reset := getattr(m, "_reset_parameters", None)):  # nn.MultiheadAttention
                reset()
            elif m in computed_later:  # computed from the base weight with its layer's adapters, below
                continue
            elif m in adapter_dicts:  # drawn as their library creates them (randn), then their layer's
                for p in m.parameters():  # initialization below
                    nn.init.normal_(p)
            else:
                raise ValueError(f"{type(m).__name__} was built under deferred_init() but has no "
                                 "reset_parameters(); pass init_fn= to the Engine to initialize it, or "
                                 "weights= to load it.")
        qualified = {m: ".".join(filter(None, (plan.name, n))) for n, m in plan.module.named_modules()}
        just_made = set(fresh)
        for m in tuner_layers:
            family.initialize_adapters(m, qualified[m], just_made, read_base)


def recompute_buffers(family: ModelFamily, name: str, module: nn.Module,
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
    own_init = family.init_for(name)
    with torch.no_grad():
        if init_fn is not None:
            init_fn(module)
        elif own_init is not None:
            own_init(module)
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
