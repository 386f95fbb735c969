"""A unit's parameters as views of its flat buffer, and the pieces of its gradients by chunk
(runtime/flat_unit.py [Note: unit gradients])."""

from __future__ import annotations

from typing import Any

import torch


def cut(flats: list[torch.Tensor], offsets: list[int], start: int, end: int) -> list[torch.Tensor]:
    """Elements [start, end) of the concatenation of `flats` (which begin at `offsets`), as views."""
    out = []
    for flat, off in zip(flats, offsets, strict=True):
        a, b = max(start, off), min(end, off + flat.numel())
        if a < b:
            out.append(flat[a - off : b - off].contiguous())  # a broadcast gradient has stride 0
    return out


class UnitViews(torch.autograd.Function):
    """The unit's parameters as views of its flat buffer (one split); backward passes their
    gradients to the unit's `on_gradient`. Without one it gives the flat buffer the concatenated
    gradient, as a plain split would."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, unit: Any) -> tuple[torch.Tensor, ...]:
        ctx.unit = unit
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None, not zeros
        sizes = [slot.numel for slot in unit.plan.slots]
        return torch.split(flat, [*sizes, unit.layout.padded - unit.layout.numel])[: len(sizes)]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        unit = ctx.unit
        if unit.on_gradient is not None:
            unit.on_gradient(list(grads))
            return None, None
        return torch.cat(unit._flat_gradients(list(grads))), None
