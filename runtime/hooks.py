"""Every hook the engine puts on the model, in one place; each body calls one named engine method.

- forward pre-hook of a unit's module: gather the unit, point its parameters at the full buffer;
- forward hook: release the unit (ZeRO-3) and arm a pre-backward hook on its outputs;
- the unit's gradient callback (`FlatUnit.on_gradient`, called from its views' backward): its
  parameters' gradients are complete, reduce them;
- a frozen unit has no gradient to say when backward is done with it: a hook on the gradients of
  its module's inputs does (runtime/units.py [Note: frozen units]).
The root unit (everything outside the repeated blocks) is gathered in the root's forward pre-hook
and released only when its own gradient is complete, or, without grad, when its forward returns
(unless a forward with grad holds it for its backward: a preference trainer's reference pass).
A module below the root that holds root parameters and is called on its own (`generate()` of an
encoder-decoder runs `model.get_encoder()` first) gathers the root unit the same way.

Under `torch.compile` every hook runs eagerly (`torch.compiler.disable`), as FSDP2's do: traced,
the engine's bookkeeping would be guarded on (a unit's index, the pending updates), so each unit
and step compiled again until dynamo's recompile limit, and the store's reads and waits cannot be
traced at all. The model's own code between the hooks compiles as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from outcore.runtime.flat_unit import FlatUnit, UnitState
from outcore.runtime.units import root_entries


class UnitHookTarget(Protocol):
    """What the hooks call: the engine's four moments in a unit's step."""

    def unit_forward_start(self, unit: FlatUnit) -> None: ...
    def unit_forward_end(self, unit: FlatUnit) -> None: ...
    def unit_backward_start(self, unit: FlatUnit) -> None: ...
    def unit_grad_ready(self, unit: FlatUnit, grads: list[torch.Tensor | None]) -> None: ...
    def unit_backward_end(self, unit: FlatUnit) -> None: ...


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook`, run eagerly under torch.compile (the module docstring says why)."""
    return torch.compiler.disable(hook, recursive=True)


def _grad_tensors(output: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]


@_eager
def refuse_a_second_backward(output: Any) -> None:
    """Arm the autograd nodes of a forward's outputs to refuse a second backward through them
    (`retain_graph=True`), where the engine lets the units' parameters go, or starts their updates,
    after the first: autograd would read freed storage and fail with a bare setStorage error."""
    for tensor in _grad_tensors(output):
        node = tensor.grad_fn
        if node is None:
            continue
        ran = [False]

        def once(grad_outputs: Any, ran: list[bool] = ran) -> None:
            if ran[0]:
                raise RuntimeError("a second backward through the same forward (retain_graph=True): the engine let "
                                   "the units' parameters go, or updated them, after the first. Sum the losses "
                                   "and call backward once, or run the forward again for each backward.")
            ran[0] = True

        node.register_prehook(once)


def register_hooks(engine: UnitHookTarget, units: list[FlatUnit], model: nn.Module) -> list[Any]:
    """Every hook of every unit (the root's entries too); returns the handles (removed by `Engine.close`)."""
    handles: list[Any] = []
    for unit in units:
        is_root = unit.plan.module is model
        handles += register_unit_hooks(engine, unit, is_root=is_root)
        if is_root:
            entries = root_entries(model, unit.plan)
            handles += register_root_entry_hooks(engine, unit, entries)
        if not unit.frozen:
            handles.append(register_grad_hook(engine, unit))
    return handles


def register_unit_hooks(engine: UnitHookTarget, unit: FlatUnit, *, is_root: bool) -> list[Any]:
    """Wire `unit` to `engine`; returns the handles (removed by `Engine.close`)."""
    module = unit.plan.module

    held: list[bool] = []  # per root forward under way: was the root unit gathered before it began

    def pre_forward(_module, _args):
        if is_root:
            held.append(unit.state is not UnitState.SHARDED)
        engine.unit_forward_start(unit)

    def post_forward(_module, _args, output):
        engine.unit_forward_end(unit)
        tensors = _grad_tensors(output)
        if tensors and not is_root:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda _grads: engine.unit_backward_start(unit), mode="any")

    def after_inputs_grads(_module, args, kwargs):
        tensors = _grad_tensors((args, kwargs)) if torch.is_grad_enabled() else []
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda _grads: engine.unit_backward_end(unit), mode="all")

    def root_without_grad(_module, _args, _output):
        # No backward will come to release it (inference, generate), unless a forward with grad
        # gathered it before this one began (a reference pass between a loss's forward and its backward).
        if not held.pop() and not torch.is_grad_enabled():
            engine.unit_backward_end(unit)

    handles = [module.register_forward_pre_hook(_eager(pre_forward))]
    if not is_root:
        handles.append(module.register_forward_hook(_eager(post_forward)))
    else:
        handles.append(module.register_forward_hook(_eager(root_without_grad)))
    if unit.frozen and not is_root:
        handles.append(module.register_forward_pre_hook(_eager(after_inputs_grads), with_kwargs=True))
    return handles


def register_root_entry_hooks(engine: UnitHookTarget, root: FlatUnit, entries: list[nn.Module]) -> list[Any]:
    """Hooks on the modules that hold root parameters (`entries`): called inside the root's forward,
    or inside another entry called on its own, they do nothing; called on their own they gather the
    root unit, and without grad let it go when they return."""
    entered: list[nn.Module] = []  # the entry called on its own that gathered the root unit

    def pre_forward(module, _args):
        if not entered and root.state is UnitState.SHARDED:
            entered.append(module)
            engine.unit_forward_start(root)

    def post_forward(module, _args, _output):
        if entered and entered[0] is module:
            entered.clear()
            if not torch.is_grad_enabled():
                engine.unit_backward_end(root)

    handles = []
    for module in entries:
        handles += [module.register_forward_pre_hook(_eager(pre_forward)),
                    module.register_forward_hook(_eager(post_forward), always_call=True)]
    return handles


def register_grad_hook(engine: UnitHookTarget, unit: FlatUnit) -> _GradientCallback:
    """The unit's gradient is complete once autograd has run its views' backward."""
    return _GradientCallback(unit, lambda grads: engine.unit_grad_ready(unit, grads))


class _GradientCallback:
    """Sets `unit.on_gradient` until `remove()`, like the handles torch's hooks return."""

    def __init__(self, unit: FlatUnit, callback: Callable[[list[torch.Tensor | None]], None]) -> None:
        self.unit = unit
        unit.on_gradient = callback

    def remove(self) -> None:
        self.unit.on_gradient = None
