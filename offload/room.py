"""Room in a memory tier for `nbytes`, found by eviction or a bounded wait.

A budget is never exceeded: a move that needs room evicts released keys (in `pick_victims`'s
order; clean copies are dropped, dirty ones written back by the writer it is given) and waits,
bounded by `wait_timeout`, for them to land, or raises `OutOfBudgetError`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NoReturn, Protocol

from outcore.offload.buffers import Buffer, HostBuffer
from outcore.offload.errors import OutOfBudgetError
from outcore.offload.eviction import pick_victims
from outcore.offload.handle import Handle
from outcore.offload.io_config import round_up
from outcore.offload.residency import KeyRecord, Move, Tier
from outcore.offload.store_state import PrefetchDropped, StoreState


class Evicts(Protocol):
    """What the room asks of the writer: move a released key out of memory."""

    def evict_record(self, rec: KeyRecord, *, demote: bool,
                     staging: HostBuffer | None = None) -> Handle[None] | None: ...


class Room:
    """Reserves room in the store's memory tiers (its lock held or taken)."""

    def __init__(self, state: StoreState, evicts: Evicts) -> None:
        self.state, self.evicts = state, evicts

    def reserve(self, tier: Tier, nbytes: int, rec: KeyRecord, move: Move | None = None,
                attempt: Callable[[], Buffer | None] | None = None) -> Buffer:
        """Room for `nbytes` in `tier`: evict released keys, then wait (bounded) for room to appear.

        A prefetch nobody waits for waits only for room already on its way out (write-backs in
        flight), and never while a request someone does wait for is waiting for room in the same
        tier: it would take that room first. Otherwise it gives up at once; see PrefetchDropped.
        """
        state = self.state
        mem = state.mem[tier]
        attempt = attempt or (lambda: mem.try_acquire(nbytes))
        deadline = time.monotonic() + state.wait_timeout
        waiting = False  # counted in demand_waiting
        with state.cond:
            errors_before = state.last_writeback_error
            try:
                while True:
                    unwanted = move is not None and move.by_prefetch and rec.pins == 0 and rec.move is move
                    if move is not None and unwanted and state.demand_waiting[tier]:
                        self._drop_prefetch(rec, move, tier)
                    buf = attempt()
                    if buf is not None:
                        return buf
                    if self._evict_for(tier, nbytes, exclude=rec, for_prefetch=unwanted):
                        continue
                    if move is not None and unwanted and not self.on_its_way(tier, nbytes):
                        self._drop_prefetch(rec, move, tier)
                    error = state.last_writeback_error
                    if error is not None and error is not errors_before:
                        raise error
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._out_of_budget(tier, nbytes, rec)
                    if not unwanted and not waiting:
                        state.demand_waiting[tier] += 1
                        waiting = True
                    state.cond.wait(min(left, 0.05))
            finally:
                if waiting:
                    state.demand_waiting[tier] -= 1

    def on_its_way(self, tier: Tier, nbytes: int) -> bool:
        """Free room plus write-backs in flight in `tier` cover `nbytes`: waiting will find it."""
        return self.state.mem[tier].available() + self.state.freeing[tier] >= round_up(max(nbytes, 1))

    def _out_of_budget(self, tier: Tier, nbytes: int, rec: KeyRecord) -> OutOfBudgetError:
        state = self.state
        pinned = sum(r.nbytes for r in state.records.values() if r.pins and r.tier == tier)
        return OutOfBudgetError(tier.name, nbytes, state.mem[tier].budget,
                                f"Waited {state.wait_timeout:.0f} s for {rec.key!r}; "
                                f"{pinned:,} bytes stay pinned in {tier.name}.")

    def _drop_prefetch(self, rec: KeyRecord, move: Move, tier: Tier) -> NoReturn:
        """Give a prefetch up: the key goes back to where it was, and the mover thread is told why."""
        rec.move = None
        rec.to(move.source)
        self.state.cond.notify_all()
        raise PrefetchDropped(f"no room in {tier.name} to prefetch {rec.key!r}")

    def _evict_for(self, tier: Tier, nbytes: int, exclude: KeyRecord, *, for_prefetch: bool = False) -> bool:
        """Start evicting the least recently used released key of `tier`; False if none can help.

        The order is `pick_victims`'s (eviction.py).
        """
        if self.on_its_way(tier, nbytes):
            return False  # enough is already on its way out
        for victim in pick_victims(self.state.records.values(), tier, exclude=exclude, for_prefetch=for_prefetch):
            if self.evicts.evict_record(victim, demote=True) is not None:
                return True
        return False
