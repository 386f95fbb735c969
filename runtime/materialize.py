"""Deferred initialization: parameters on the meta device, materialized one unit at a time.

    with outcore.deferred_init():
        model = MyModel()          # parameters take no memory: they are on the meta device
    engine = outcore.Engine(model, config)   # each unit is materialized, sharded, then dropped

Only parameters go to the meta device, as each is registered (through torch's parameter
registration hook, as Accelerate's `init_empty_weights(include_buffers=False)` does): buffers
computed in `__init__` (rotary tables, masks) keep their real values. A parameter is created on the
CPU first and moved at once, so the transient is one parameter, and `torch.empty` costs no memory
until touched. While the context is open this applies to modules built by any thread.

A module's parameters are then initialized by `init_fn(module)` when given, else by its own
`reset_parameters()` (or come from `weights=`; see runtime/pretrained.py). Each unit draws from its
own seeded generator state, so initialization is reproducible and does not depend on the split.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from outcore.runtime.units import UnitPlan


@contextlib.contextmanager
def deferred_init() -> Iterator[None]:
    """Build modules whose parameters are shapes only (the meta device); buffers stay real."""
    # torch annotates the hook as returning None, though it documents (and applies) a returned parameter.
    handle = register_module_parameter_registration_hook(_on_the_meta_device)  # type: ignore[arg-type]
    try:
        yield
    finally:
        handle.remove()


def _on_the_meta_device(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    if param is None or param.is_meta:
        return None
    return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)


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
    fresh = []
    for m in _unit_modules(plan, model, in_units):
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
            else:
                raise ValueError(f"{type(m).__name__} was built under deferred_init() but has no "
                                 "reset_parameters(); pass init_fn= to the Engine to initialize it, or "
                                 "weights= to load it.")
        for m in _unit_modules(plan, model, in_units):
            reset_lora = getattr(m, "reset_lora_parameters", None)
            lora_a = getattr(m, "lora_A", None)
            if init_fn is None and callable(reset_lora) and isinstance(lora_a, nn.ModuleDict):
                for adapter, layer in lora_a.items():
                    if any(c in fresh for c in layer.modules()):
                        reset_lora(adapter, lora_init)
