"""A module computed over tiles of the sequence (ALST's TiledMLP): in forward each tile runs without
keeping its intermediates, and in backward each tile is run again and differentiated on its own, so
that a decoder block's MLP holds one tile's intermediates (tile x the MLP's width x 3), not the whole
sequence's. Only the input is kept for backward, as checkpointing keeps it.

The module must treat positions independently (an MLP does; attention does not). The parameters'
gradients are summed over the tiles and returned to autograd as the function's own, so that whatever
gathers and reduces them (the engine's unit hooks) sees one gradient a parameter, as from the untiled
module, inside an engine's unit too (whose parameters are views set in their place, bound again for
backward: `weights_of`). Equal to the untiled module to rounding (the same operations, a tile at a
time). hf/tiled_mlp.py installs it on a Hugging Face decoder's MLPs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], tile: int, dim: int,
                x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.module, ctx.fn, ctx.tile, ctx.dim = module, fn, tile, dim
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(piece) for piece in x.split(tile, dim)], dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        params = weights_of(ctx.module)  # as bound now: an engine binds a unit's views again for backward
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[5:], strict=True) if need]
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[4] else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        at = 0
        for piece, grad_piece in zip(x.split(ctx.tile, ctx.dim), grad.split(ctx.tile, ctx.dim), strict=True):
            with torch.enable_grad():
                inp = piece.detach().requires_grad_(grad_x is not None)
                out = ctx.fn(inp)
                inputs = ([inp] if grad_x is not None else []) + wanted
                got = torch.autograd.grad(out, inputs, grad_piece, allow_unused=True)
            if grad_x is not None:
                grad_x.narrow(ctx.dim, at, piece.shape[ctx.dim]).copy_(got[0])
                got = got[1:]
            sums = [s if g is None else g if s is None else s.add_(g) for s, g in zip(sums, got, strict=True)]
            at += piece.shape[ctx.dim]
        by_param = iter(sums)
        param_grads = [next(by_param) if need else None for need in ctx.needs_input_grad[5:]]
        return (None, None, None, None, grad_x, *param_grads)


def weights_of(module: nn.Module) -> list[torch.Tensor]:
    """The tensors `module`'s forward reads its weights from, in a fixed order: its parameters, and the
    tensors set as plain attributes in their place (an engine's views of a gathered unit)."""
    found: list[torch.Tensor] = []
    for m in module.modules():
        found += [p for p in m._parameters.values() if p is not None]
        found += [v for _, v in sorted(vars(m).items()) if isinstance(v, torch.Tensor)]
    return found


def tiled(module: nn.Module, x: torch.Tensor, tile: int, dim: int = 1,
          fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """`module(x)` computed `tile` positions of `dim` at a time (see the module's docstring); or
    `fn(x)`, where `fn` computes with `module`'s weights (its own forward, where that forward is
    what calls this)."""
    if tile < 1:
        raise ValueError(f"tile={tile}: a tile is at least one position.")
    fn = fn or module
    if x.shape[dim] <= tile:
        return fn(x)
    return _Tiled.apply(module, fn, tile, dim, x, *weights_of(module))
