"""Every hook the engine puts on the model, in one place; each body calls one named engine method.

- forward pre-hook of a unit's module: gather the unit, point its parameters at the full buffer;
- forward hook: release the unit (ZeRO-3) and arm a pre-backward hook on its outputs;
- post-accumulate-grad hook of the unit's flat buffer: its gradient is complete, reduce it.
The root unit (everything outside the repeated blocks) is gathered in the root's forward pre-hook
and released only when its own gradient is complete.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_leaves

from runtime.flat_unit import FlatUnit

if TYPE_CHECKING:
    from runtime.engine import Engine


def _grad_tensors(output) -> list[torch.Tensor]:
    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]


def register_unit_hooks(engine: Engine, unit: FlatUnit, *, is_root: bool) -> list:
    """Wire `unit` to `engine`; returns the handles (removed by `Engine.close`)."""
    module = unit.plan.module

    def pre_forward(_module, _args):
        engine.unit_forward_start(unit)

    def post_forward(_module, _args, output):
        engine.unit_forward_end(unit)
        tensors = _grad_tensors(output)
        if tensors and not is_root:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda _grads: engine.unit_backward_start(unit), mode="any")

    handles = [module.register_forward_pre_hook(pre_forward)]
    if not is_root:
        handles.append(module.register_forward_hook(post_forward))
    return handles


def register_grad_hook(engine: Engine, unit: FlatUnit):
    """The unit's gradient is complete once autograd has accumulated into its flat leaf."""
    return unit.flat.register_post_accumulate_grad_hook(lambda _flat: engine.unit_grad_ready(unit))
