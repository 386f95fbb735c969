"""The model's states as the engine laid them out: what checkpoints, state dicts and export read."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from outcore.offload import TieredStore
from outcore.runtime.collectives import Group
from outcore.runtime.flat_unit import FlatUnit
from outcore.runtime.policy import Placement
from outcore.runtime.update_stream import UpdateStream

# The engine's parameters are views it sets as plain attributes, not registered parameters. Models
# that read their device and dtype from their first parameter (Hugging Face's `model.device`,
# `model.dtype`, which `generate()` uses) find this zero-size one on the root instead.
ANCHOR = "outcore_anchor"


@dataclass(frozen=True, eq=False)
class ShardedModel:
    """The wrapped model, its units and where their shards rest.

    Readers call `settle()` first: it waits for every update in flight, so what they read is the
    state after the last `step()`.
    """

    model: nn.Module
    units: list[FlatUnit]
    store: TieredStore
    place: Placement
    group: Group
    updates: UpdateStream
    state_dict_keys: list[str]  # `model.state_dict()`'s keys, in its order, taken before sharding

    def settle(self) -> None:
        self.updates.drain()

    def anchor(self, device: torch.device, dtype: torch.dtype) -> None:
        """Register the zero-size parameter of `ANCHOR` on the root module."""
        self.model.register_parameter(ANCHOR, nn.Parameter(torch.empty(0, device=device, dtype=dtype),
                                                           requires_grad=False))

    def buffers(self) -> dict[str, torch.Tensor]:
        """The model's buffers by state-dict name (all its state dict holds once sharded), on CPU."""
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items() if k != ANCHOR}
