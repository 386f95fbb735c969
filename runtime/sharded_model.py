"""The model's states as the engine laid them out: what checkpoints, state dicts and export read."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from outcore.offload import TieredStore
from outcore.runtime.collectives import Group
from outcore.runtime.flat_unit import FlatUnit
from outcore.runtime.policy import Placement
from outcore.runtime.update_stream import UpdateStream


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
