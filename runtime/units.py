"""Fetch units: which modules move together, and which parameters each one owns.

A pure planner: it looks at the module tree and returns a plan; nothing is moved or changed here.
The units are the repeated blocks (or the modules of the classes the config names), then, when the
blocks were found automatically, every module outside them that is at least as large as a block
(an untied head, an embedding), and last the root unit with everything else.

[Note: frozen units] Parameters that do not require grad (a frozen base under LoRA, a frozen
embedding) are planned apart from the trainable ones of the same module: a module with both gets
two units, the trainable one and its frozen sibling, which move together but keep separate flat
buffers. A frozen unit has no gradient and no optimizer state; its shard rests in the compute
dtype and is never written back.

[Note: unit ownership] A parameter belongs to the unit whose subtree holds every module that
registers it. A parameter shared across units (tied embeddings: the embedding in the root and the
head in the root, or a block's weight reused elsewhere) belongs to their common ancestor's unit,
which is the root unit, and is flattened (and updated) once. So does a module registered in two
blocks, or in a block and outside it: what counts is where each registration runs. Every place it
appears — (module, attribute name) — is recorded, so the gathered view is set at each of them.

[Note: block lists] Without `unit_classes`, the blocks are the children of every outermost
ModuleList/Sequential/ModuleDict of repeated blocks (`_is_block_list`): a decoder's layers; both stacks of an
encoder-decoder; the layers, not the experts inside each, of a mixture of experts; the model
itself when it is a Sequential of blocks. A list inside a block is part of that block.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import nn

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ParamSlot:
    """One unique parameter of a unit and every (module, name) it is registered under."""

    param: nn.Parameter | None  # None once the engine has flattened it
    shape: torch.Size
    frozen: bool = False  # requires_grad=False
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
    frozen: bool = False  # see [Note: frozen units]
    root: bool = False  # the root unit (or its frozen sibling)
    outer: bool = False  # a large module outside the blocks (`_outer_units`), or its frozen sibling

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)


def _is_block_list(m: nn.Module) -> bool:
    """A ModuleList/Sequential/ModuleDict (torchtitan keeps its layers in one) of repeated blocks:
    every child holds parameters, and a class repeats among them (a hybrid's two or three kinds of
    layer too). A block's own list of different parts (T5's attention and feed-forward layers) or a
    model written as `Sequential(embedding, stack, head)` is not one."""
    if not isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
        return False
    children = list(m.children())
    if len(children) < 2 or not all(any(True for _ in c.parameters()) for c in children):
        return False
    return Counter(type(c) for c in children).most_common(1)[0][1] >= 2


def _block_lists(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of every outermost list of blocks ([Note: block lists])."""
    lists: list[str] = []
    blocks: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():  # a module comes before the modules inside it
        if any(name.startswith(outer + ".") for outer in lists) or not _is_block_list(m):
            continue
        lists.append(name)
        blocks.extend((f"{name}.{child}" if name else child, c) for child, c in m.named_children())
    return blocks


def _outer_units(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Outermost modules outside the blocks that hold at least as many parameters as the smallest
    block (an untied head, a large embedding). Left in the root unit they would stay gathered for
    the whole step, and their optimizer update would wait for the end of backward; as units of
    their own they are gathered only while they run and updated as soon as their gradient is done."""
    if not blocks:
        return []
    smallest = min(sum(p.numel() for p in b.parameters()) for _, b in blocks)
    in_blocks = {m for _, b in blocks for m in b.modules()}
    holds_blocks = {".".join(name.split(".")[:i]) for name, _ in blocks for i in range(1, name.count(".") + 1)}
    return _outermost((name, m) for name, m in model.named_modules()
                      if m is not model and m not in in_blocks and name not in holds_blocks
                      and sum(p.numel() for p in m.parameters()) >= smallest)


def _by_class(model: nn.Module, unit_classes: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """Outermost modules whose class name is listed (a listed module inside another is not a unit)."""
    return _outermost((name, m) for name, m in model.named_modules()
                      if m is not model and type(m).__name__ in unit_classes)


def _outermost(candidates) -> list[tuple[str, nn.Module]]:
    """Candidates in module order, leaving out any inside one already taken."""
    chosen: list[tuple[str, nn.Module]] = []
    for name, m in candidates:
        if not any(name.startswith(prev + ".") for prev, _ in chosen):
            chosen.append((name, m))
    return chosen


def _check_dtypes(model: nn.Module) -> None:
    """Units are flat floating-point buffers in the compute dtype, with fp32 masters: an integer or
    complex parameter cannot be one (it would be cast, and fail far from here), and a float64 one
    trains at fp32's precision, which is said once."""
    params = list(model.named_parameters())
    odd = [(n, p.dtype) for n, p in params if not p.is_floating_point()]
    if odd:
        name, dtype = odd[0]
        raise ValueError(f"parameter {name!r} is {dtype}{f' (and {len(odd) - 1} more)' if len(odd) > 1 else ''}: "
                         "outcore lays parameters out as floating-point units, so it cannot hold it. An index, "
                         "mask or quantized table is state rather than a weight: register it with "
                         "register_buffer instead.")
    wide = [n for n, p in params if p.dtype == torch.float64]
    if wide:
        log.warning("%d float64 parameter(s) (%s%s) are trained in Config.dtype with fp32 master weights, "
                    "not in float64", len(wide), ", ".join(wide[:3]), ", ..." if len(wide) > 3 else "")


def plan_units(model: nn.Module, unit_classes: tuple[str, ...] = (),
               in_root: Collection[nn.Module] = ()) -> list[UnitPlan]:
    """Units in module order, with the root unit last (index len-1); see [Note: unit ownership].
    Modules in `in_root` are never units of their own (`ModelFamily.read_outside_forward`)."""
    lazy = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if nn.parameter.is_lazy(t)]
    if lazy:
        raise ValueError(f"{type(model).__name__} has parameters whose shapes are not known yet (lazy modules: "
                         f"{', '.join(lazy[:4])}{', ...' if len(lazy) > 4 else ''}): run one forward on a sample "
                         "input first, then build the Engine, which lays out each parameter's shard by its shape.")
    _check_dtypes(model)
    outer_names: set[str] = set()  # large modules outside the blocks, units only when blocks are found
    if unit_classes:
        blocks = _by_class(model, unit_classes)
        if not blocks:
            raise ValueError(f"unit_classes={list(unit_classes)} matches no module of {type(model).__name__}; "
                             "name classes that exist in the model, or leave it empty to use the repeated blocks.")
    else:
        blocks = _block_lists(model)
        if not blocks:
            log.warning("%s has no list of repeated blocks: it is one unit, gathered whole for every step. Name "
                        "its block classes in Config.unit_classes to page it in parts.", type(model).__name__)
        outer = [(name, m) for name, m in _outer_units(model, blocks) if m not in in_root]
        outer_names = {name for name, _ in outer}
        order = {name: i for i, (name, _) in enumerate(model.named_modules())}
        blocks = sorted(blocks + outer, key=lambda nm: order[nm[0]])
    units = [UnitPlan(i, name, m, outer=name in outer_names) for i, (name, m) in enumerate(blocks)]
    root = UnitPlan(len(units), "", model)
    block_unit = {id(u.module): u for u in units}
    by_path = dict(model.named_modules(remove_duplicate=False))

    def unit_at(path: str) -> UnitPlan:
        """The unit of the block this module path runs inside (by the modules along it, so that
        another name for the same block finds it too); the root unit outside every block."""
        parts = path.split(".") if path else []
        for end in range(len(parts), 0, -1):
            found = block_unit.get(id(by_path[".".join(parts[:end])]))
            if found is not None:
                return found
        return root

    owner: dict[nn.Parameter, UnitPlan] = {}
    slots: dict[nn.Parameter, ParamSlot] = {}
    for mod_name, m in by_path.items():
        for pname, p in m._parameters.items():
            if p is None:
                continue
            unit = unit_at(mod_name)
            if p not in slots:
                slots[p] = ParamSlot(p, p.shape, frozen=not p.requires_grad)
                owner[p] = unit
            elif owner[p] is not unit:
                owner[p] = root  # shared across units: the common ancestor owns it
            slot = slots[p]
            if (m, pname) not in slot.places:
                slot.places.append((m, pname))
            slot.state_dict_names.append(f"{mod_name}.{pname}" if mod_name else pname)
    for p, slot in slots.items():
        owner[p].slots.append(slot)
    root.root = True
    planned = [part for u in [*units, root] for part in _split_frozen(u)]
    for i, u in enumerate(planned):
        u.index = i
    return planned


def root_entries(model: nn.Module, root: UnitPlan) -> list[nn.Module]:
    """Every module below the root that holds (itself or inside it) a parameter of the root unit
    `root`: the ways in which the root unit may be used without the root's own forward (T5's
    encoder, which `generate()` calls on its own; under peft, the same encoder one wrapper deeper)."""
    places = {id(m) for s in root.slots for m, _ in s.places}
    modules = dict(model.named_modules(remove_duplicate=False))
    names = [name for name, m in modules.items() if id(m) in places]
    above = {".".join(name.split(".")[:end]) for name in names for end in range(1, name.count(".") + 2) if name}
    return list({id(modules[name]): modules[name] for name in sorted(above)}.values())


def _split_frozen(unit: UnitPlan) -> list[UnitPlan]:
    """The unit's trainable part, then its frozen sibling (either left out when empty)."""
    trainable = [s for s in unit.slots if not s.frozen]
    frozen = [s for s in unit.slots if s.frozen]
    parts = []
    for slots, is_frozen in ((trainable, False), (frozen, True)):
        if slots:
            parts.append(UnitPlan(unit.index, unit.name, unit.module, slots, frozen=is_frozen, root=unit.root,
                                  outer=unit.outer))
    return parts


def plan_layout(plans: list[UnitPlan]) -> tuple[list[int], dict[str, list]]:
    """Parameters per unit, and what the memory plan needs beside them: which units are frozen,
    which are the root's, which share a module (a unit and its frozen sibling), and which are large
    modules outside the blocks."""
    modules: dict[int, int] = {}
    return [p.numel for p in plans], {
        "frozen": [p.frozen for p in plans], "roots": [p.root for p in plans],
        "modules": [modules.setdefault(id(p.module), len(modules)) for p in plans],
        "outer": [p.outer for p in plans]}
