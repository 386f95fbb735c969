"""Sequence tiling (runtime/tiled.py) installed on a Hugging Face decoder's MLPs: each decoder layer's
`mlp` computes `tile_tokens` positions at a time in forward and in backward, so that one layer's
MLP holds a tile's wide intermediates (tile x intermediate_size x 3), not the sequence's. A sequence
no longer than a tile runs the MLP as it is.

    install_tiled_mlp(model, tile_tokens=4096)   # before outcore.Engine(model, ...)

Only a position-wise MLP is tiled: a mixture of experts (its router balances over the whole batch)
is refused, and so is one with active dropout (a tile run again in backward would draw other masks).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from outcore.runtime.tiled import tiled

TILED = "outcore_tiled"  # marks an MLP whose forward was replaced here
TILE_SHARE = 1 / 16  # of the free memory: one layer's wide MLP values in a tile at most (`chosen_tile`)
MLP_VALUES = 8  # values of the width a position's MLP keeps (its wide layer and activation, 2 x 4;
# tools/activations.py counts them among a block's 17)


def tile_room(width: int, memory: int, elem: int = 2) -> int:
    """Tokens whose wide MLP values (of a layer `width` wide, `elem` bytes a value) take at most
    `TILE_SHARE` of `memory`."""
    return int(memory * TILE_SHARE) // (MLP_VALUES * width * elem)


def chosen_tile(width: int, free_memory: int, elem: int = 2) -> int:
    """A tile where none is given: the most tokens, a power of two, within `tile_room`."""
    return 1 << max(0, tile_room(width, free_memory, elem).bit_length() - 1)


def decoder_mlps(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's MLP: the `mlp` of every module that has a `self_attn` beside it."""
    found = [getattr(m, "mlp", None) for m in model.modules() if isinstance(getattr(m, "self_attn", None), nn.Module)]
    return [mlp for mlp in found if isinstance(mlp, nn.Module)]


def install_tiled_mlp(model: nn.Module, tile_tokens: int) -> int:
    """Tile every decoder layer's MLP over `tile_tokens` positions; the number of MLPs tiled."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens={tile_tokens}: a tile is at least one token.")
    mlps = decoder_mlps(model)
    if not mlps:
        raise ValueError(f"{type(model).__name__}: no decoder layer with an `mlp` beside its `self_attn` to tile; "
                         "leave tiling off for this model.")
    for mlp in mlps:
        _refuse_untileable(mlp)
    for mlp in mlps:
        if getattr(mlp.forward, TILED, False):
            continue
        own = type(mlp).forward

        def forward(self: nn.Module, x: torch.Tensor, *args: Any, _own: Any = own, **kwargs: Any) -> torch.Tensor:
            if args or kwargs or x.dim() < 2:
                return _own(self, x, *args, **kwargs)
            return tiled(self, x, tile_tokens, dim=x.dim() - 2, fn=lambda piece: _own(self, piece))

        setattr(forward, TILED, True)
        mlp.forward = types.MethodType(forward, mlp)
    return len(mlps)


def _refuse_untileable(mlp: nn.Module) -> None:
    name = type(mlp).__name__
    if hasattr(mlp, "experts") or hasattr(mlp, "router"):
        raise ValueError(f"{name} is a mixture of experts, whose routing is not position by position: tiling the "
                         "sequence is for dense MLPs; leave it off for this model (--tile-tokens 0).")
    dropping = [m for m in mlp.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if dropping:
        raise ValueError(f"{name} has dropout (p={dropping[0].p}), which a tile computed again in backward would "
                         "draw anew: set the dropout to 0 (lora_dropout=0), or leave tiling off (--tile-tokens 0).")
