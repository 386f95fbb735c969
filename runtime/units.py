"""Fetch units: which modules move together, and which parameters each one owns.

A pure planner: it looks at the module tree and returns a plan; nothing is moved or changed here.

[Note: unit ownership] A parameter belongs to the unit whose subtree holds every module that
registers it. A parameter shared across units (tied embeddings: the embedding in the root and the
head in the root, or a block's weight reused elsewhere) belongs to their common ancestor's unit,
which is the root unit, and is flattened (and updated) once. Every place it appears — (module,
attribute name) — is recorded, so the gathered view is set at each of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(eq=False)
class ParamSlot:
    """One unique parameter of a unit and every (module, name) it is registered under."""

    param: nn.Parameter | None  # None once the engine has flattened it
    shape: torch.Size
    places: list[tuple[nn.Module, str]] = field(default_factory=list)
    state_dict_names: list[str] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass(eq=False)
class UnitPlan:
    """A fetch unit: a module (the root for the root unit) and the parameters it owns."""

    index: int
    name: str
    module: nn.Module
    slots: list[ParamSlot] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)


def _deepest_block_list(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Children of the deepest ModuleList/Sequential whose children hold parameters."""
    best: tuple[int, str, nn.Module] | None = None
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2 or m is model:
            continue
        if not all(any(True for _ in c.parameters()) for c in m):
            continue
        depth = name.count(".") + 1
        if best is None or depth > best[0]:
            best = (depth, name, m)
    if best is None:
        return []
    _, name, container = best
    return [(f"{name}.{i}", child) for i, child in enumerate(container)]


def _by_class(model: nn.Module, unit_classes: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """Outermost modules whose class name is listed (a listed module inside another is not a unit)."""
    chosen: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if m is model or type(m).__name__ not in unit_classes:
            continue
        if any(name.startswith(prev + ".") for prev, _ in chosen):
            continue
        chosen.append((name, m))
    return chosen


def plan_units(model: nn.Module, unit_classes: tuple[str, ...] = ()) -> list[UnitPlan]:
    """Units in module order, with the root unit last (index len-1); see [Note: unit ownership]."""
    blocks = _by_class(model, unit_classes) if unit_classes else _deepest_block_list(model)
    if unit_classes and not blocks:
        raise ValueError(f"unit_classes={list(unit_classes)} matches no module of {type(model).__name__}; "
                         "name classes that exist in the model, or leave it empty to use the repeated blocks.")
    units = [UnitPlan(i, name, m) for i, (name, m) in enumerate(blocks)]
    root = UnitPlan(len(units), "", model)
    module_unit: dict[nn.Module, UnitPlan] = {}
    for u in units:
        for m in u.module.modules():
            module_unit[m] = u
    owner: dict[nn.Parameter, UnitPlan] = {}
    slots: dict[nn.Parameter, ParamSlot] = {}
    for mod_name, m in model.named_modules(remove_duplicate=False):
        for pname, p in m._parameters.items():
            if p is None:
                continue
            unit = module_unit.get(m, root)
            if p not in slots:
                slots[p] = ParamSlot(p, p.shape)
                owner[p] = unit
            elif owner[p] is not unit:
                owner[p] = root  # shared across units: the common ancestor owns it
            slot = slots[p]
            if (m, pname) not in slot.places:
                slot.places.append((m, pname))
            slot.state_dict_names.append(f"{mod_name}.{pname}" if mod_name else pname)
    for p, slot in slots.items():
        if not p.requires_grad:
            raise ValueError(f"parameter {slot.state_dict_names[0]!r} does not require grad; outcore trains every "
                             "parameter it shards: register frozen tensors as buffers instead.")
        owner[p].slots.append(slot)
    planned = [u for u in units if u.slots] + ([root] if root.slots else [])
    for i, u in enumerate(planned):
        u.index = i
    return planned
