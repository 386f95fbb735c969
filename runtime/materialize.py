"""Deferred initialization: models built on the meta device, materialized one unit at a time.

    with outcore.deferred_init():
        model = MyModel()          # no real memory: every tensor is on the meta device
    engine = outcore.Engine(model, config)   # each unit is materialized, sharded, then dropped

A module is initialized by `init_fn(module)` when given, else by its own `reset_parameters()`.
Each unit draws from its own seeded generator state, so initialization is reproducible and does
not depend on how the model was split. Buffers computed in `__init__` (rotary tables, masks) are
lost on the meta device: recompute them in `reset_parameters` or `init_fn`.
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


def _unit_modules(plan: UnitPlan, model: nn.Module, in_units: set[nn.Module]) -> list[nn.Module]:
    if plan.module is model:  # the root unit: every module that no block unit holds
        return [m for m in model.modules() if m not in in_units]
    return list(plan.module.modules())


def materialize_unit(plan: UnitPlan, model: nn.Module, in_units: set[nn.Module], *,
                     init_fn: Callable[[nn.Module], None] | None, seed: int) -> None:
    """Give the unit's meta tensors real CPU memory and initialize them (no-op when already real)."""
    modules = _unit_modules(plan, model, in_units)
    if not any(t.is_meta for m in modules for t in (*m._parameters.values(), *m._buffers.values())
               if t is not None):
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + plan.index)
        for m in modules:
            if any(t is not None and t.is_meta for t in (*m._parameters.values(), *m._buffers.values())):
                m.to_empty(device="cpu", recurse=False)
                with torch.no_grad():
                    if init_fn is not None:
                        init_fn(m)
                    elif callable(reset := getattr(m, "reset_parameters", None)):
                        reset()
                    elif callable(reset := getattr(m, "_reset_parameters", None)):  # nn.MultiheadAttention
                        reset()
                    elif m._parameters:
                        raise ValueError(f"{type(m).__name__} was built under deferred_init() but has no "
                                         "reset_parameters(); pass init_fn= to the Engine to initialize it.")
