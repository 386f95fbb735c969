"""Forward passes repeated without grad over the same units: generation, evaluation, a reference
model's log-probabilities.

[Note: forward cycles] Decoding runs the units 1..N for one token, then 1..N again for the next.
Under a budget that holds k of the N, evicting the least recently used throws out exactly the unit
needed soonest, so every token would read all N. A run of no-grad passes (a *cycle*) keeps a fixed
set instead. Its first pass records the order the units run in; from the second on, the largest
units that fit in the DEVICE budget beside the window the others stream through stay gathered until
the cycle ends, and on a CPU, where both tiers are RAM, so do those that fit in the HOST budget
(borrowed where they rest there). A kept unit is gathered once and its
views bound once: its hooks find it gathered and return. The others are gathered and let go as in
training, each prefetched ahead in the cycle's order, wrapping from the last unit to the first (the
next token's). A token then reads the streamed units' bytes: the model's bytes outside the budgets.

A cycle never starts while a forward with grad waits for its backward (a preference trainer's
reference pass between them), and ends at anything else the engine does (a forward with grad, a
backward, a step, a save, an export): its units are let go then, and training's order and policy are
as they were. With several ranks each kept unit would hold a whole gathered copy beside the budgets,
so there the units are gathered for each pass as before, prefetched in the cycle's order.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from outcore.offload import Tier, TieredStore
from outcore.offload.io_config import round_up
from outcore.runtime.flat_unit import FlatUnit, UnitState

log = logging.getLogger("outcore.runtime.engine")


@dataclass(frozen=True)
class CyclePlan:
    """Which units a cycle keeps gathered, and where; the rest stream, in the cycle's order."""

    order: tuple[int, ...]  # unit indices as the cycle's first pass ran them
    kept: dict[int, Tier]  # unit index -> the tier its gathered bytes are borrowed from
    streamed: tuple[int, ...]
    ahead: int = 1  # streamed units prefetched ahead of the one running

    def streamed_after(self, unit: int, count: int) -> list[int]:
        """The next `count` streamed units after `unit` in the order, wrapping to the next pass."""
        if not self.streamed or unit not in self.order:
            return []
        at = self.order.index(unit)
        ahead = [self.order[(at + k) % len(self.order)] for k in range(1, len(self.order) + 1)]
        return [i for i in ahead if i not in self.kept][: min(count, len(self.streamed))]


def plan_cycle(order: list[int], sizes: dict[int, int], *, device_room: int, host_room: int,
               window: int) -> CyclePlan:
    """Keep the largest units of `order` that fit in `device_room`, then in `host_room` (which units
    a cycle keeps does not change the bytes a pass reads, but the largest streamed unit sizes the
    window); where not all fit, `window` bytes of DEVICE stay free for the streamed units (the one
    running and those prefetched)."""
    if sum(sizes[i] for i in order) <= device_room:
        return CyclePlan(tuple(order), dict.fromkeys(order, Tier.DEVICE), ())
    kept: dict[int, Tier] = {}
    for tier, room in ((Tier.DEVICE, device_room - window), (Tier.HOST, host_room)):
        for i in sorted(order, key=lambda i: -sizes[i]):  # stable: in order among equals
            if i not in kept and sizes[i] <= room:
                room -= sizes[i]
                kept[i] = tier
    kept = _spread(order, sizes, kept)
    return CyclePlan(tuple(order), kept, tuple(i for i in order if i not in kept))


def _spread(order: list[int], sizes: dict[int, int], kept: dict[int, Tier]) -> dict[int, Tier]:
    """`kept` with the streamed units of each size spread evenly over the order among the units of
    that size (the same bytes kept in each tier): a streamed unit read while the kept ones before it
    run arrives in time, where a run of streamed units back to back would wait for each read."""
    out: dict[int, Tier] = {}
    for size in set(sizes[i] for i in order):
        same = [i for i in order if sizes[i] == size]
        tiers = [kept[i] for i in same if i in kept]  # in order: DEVICE ones first, as chosen
        streamed = len(same) - len(tiers)
        if not streamed:
            out.update({i: kept[i] for i in same})
            continue
        stream_at = {same[(k + 1) * len(same) // streamed - 1] for k in range(streamed)}
        out.update(zip([i for i in same if i not in stream_at], tiers, strict=True))
    return out


class ForwardCycle:
    """The lifecycle's cycle of no-grad passes ([Note: forward cycles])."""

    def __init__(self, units: list[FlatUnit], store: TieredStore, *, world: int, device_ahead: int,
                 prefetch_depth: int, params_on_nvme: bool) -> None:
        self.units, self.store, self.world = units, store, world
        self.device_ahead, self.depth, self.params_on_nvme = device_ahead, prefetch_depth, params_on_nvme
        self.recording: list[int] | None = None  # the order of the units' first runs, until it is planned
        self.visits = 0  # unit runs while recording
        self.cycled = 0  # units not resident, counted as recording begins
        self.plan: CyclePlan | None = None
        self.held: set[int] = set()  # units gathered for the whole cycle, in the plan's tier
        self._said = False

    @property
    def active(self) -> bool:
        return self.plan is not None or self.recording is not None

    def visit(self, unit: FlatUnit, *, pending_backward: bool) -> list[int]:
        """`unit` starts a forward without grad: the cycle begins (unless a forward with grad waits for
        its backward) or goes on. While the first pass runs, its order is recorded, and planned once
        every unit has run and one runs again (a model that leaves some unit out: after twice as
        many runs as units). Returns the streamed units to prefetch now."""
        if not self.active:
            if pending_backward:
                return []
            self.recording, self.visits = [], 0
            self.cycled = sum(1 for u in self.units if not u.resident)  # the units a pass gathers
        if self.recording is not None:
            self.visits += 1
            seen = unit.index in self.recording
            if not seen:
                self.recording.append(unit.index)
            if (seen and len(self.recording) == self.cycled) or self.visits > 2 * len(self.units):
                order, self.recording = self.recording, None
                self.plan = self._plan(order)
        return [] if self.plan is None else self.plan.streamed_after(unit.index, self.plan.ahead)

    def keeps(self, unit: FlatUnit) -> Tier | None:
        """The tier `unit` is to be gathered in and stay for the cycle (`gathered` says it was), or
        None where it streams."""
        return None if self.plan is None else self.plan.kept.get(unit.index)

    def gathered(self, unit: FlatUnit) -> None:
        assert unit.state is UnitState.UNSHARDED
        self.held.add(unit.index)

    def holds(self, unit: FlatUnit) -> bool:
        """`unit` is gathered for the whole cycle: not let go at the end of its forward."""
        return unit.index in self.held

    def end(self) -> None:
        """The cycle is over: its kept units let go."""
        held, self.held = self.held, set()
        self.plan, self.recording = None, None
        for index in held:
            self.units[index].release()

    def preview(self) -> CyclePlan:
        """The plan a cycle would make now, in the units' own order (the root first): what the start
        of a generating run says it will keep and read."""
        return self._plan([self.units[-1].index, *(u.index for u in self.units[:-1])], quiet=True)

    def _plan(self, order: list[int], *, quiet: bool = False) -> CyclePlan:
        units = [self.units[i] for i in order]
        if self.world > 1 or any(not (u.borrowing or u.decodes_in_store) for u in units if not u.resident):
            if not self._said and not quiet:
                self._said = True
                log.info("forward passes without grad gather each unit again for each pass (%s)",
                         "several ranks" if self.world > 1 else "units gathered by copying")
            return CyclePlan(tuple(order), {}, tuple(i for i in order if not self.units[i].resident))
        order = [i for i in order if not self.units[i].resident]
        sizes = {i: round_up(self.units[i].gathered_nbytes) for i in order}
        stored = {i: round_up(self.units[i].stored_nbytes) for i in order}
        device_room, host_room = self._rooms(quiet)

        def planned(ahead: int) -> CyclePlan:
            def window(streaming: Iterable[int]) -> int:  # the unit running (a quantized one's codes
                units = list(streaming) or [0]  # beside its values) and those prefetched onto DEVICE
                running = max(sizes.get(i, 0) + (stored.get(i, 0) if self.units[i].decodes_in_store else 0)
                              for i in units)
                return running + min(ahead, self.device_ahead) * max(stored.get(i, 0) for i in units)

            first = plan_cycle(order, sizes, device_room=device_room, host_room=host_room, window=window(order))
            # Again with the window of the units that stream: no larger ones than the first plan's.
            plan = plan_cycle(order, sizes, device_room=device_room, host_room=host_room,
                              window=window(first.streamed))
            return dataclasses.replace(plan, ahead=ahead)

        # One unit read ahead leaves the most room to keep, and is time enough where three kept units
        # or more compute between two streamed ones (they are spread); else the prefetch depth.
        plan = planned(1)
        if len(plan.streamed) * 4 > len(order) and self.depth > 1:
            plan = planned(self.depth)
        if not quiet:
            log.info("a cycle of forward passes keeps %d of %d units gathered (%d bytes); %d stream, %d bytes a pass",
                     len(plan.kept), len(order), sum(sizes[i] for i in plan.kept), len(plan.streamed),
                     self.streamed_bytes(plan))
        return plan

    def _rooms(self, quiet: bool) -> tuple[int, int]:
        """The DEVICE and HOST bytes a cycle may keep units in: the budgets, less what else rests
        there (optimizer states, gradients: evicted, they would be written back and read again at the
        next step). HOST only on a CPU, where a unit computes where it rests."""
        stats = self.store.stats()
        params_in = {Tier.DEVICE: 0, Tier.HOST: 0}
        for u in self.units:
            tier = self.store.tier_of(u.param_key)
            if tier in params_in and not u.resident:
                params_in[tier] += round_up(u.stored_nbytes)
        others = {t: max(0, stats[t.name.lower()]["resident"] - params_in[t]) for t in params_in}
        host_room = stats["host"]["budget"] - others[Tier.HOST] if self.store.zero_copy and self.params_on_nvme else 0
        if not self.store.zero_copy and self.params_on_nvme and not self._said and not quiet:
            self._said = True
            log.info("forward passes without grad keep units gathered in the device budget only; the host budget "
                     "holds the others' shards as they page")
        return stats["device"]["budget"] - others[Tier.DEVICE], host_room

    def streamed_bytes(self, plan: CyclePlan | None = None) -> int:
        """The stored bytes a pass reads again: the streamed units' shards."""
        plan = plan or self.plan
        return 0 if plan is None else sum(self.units[i].stored_nbytes for i in plan.streamed)
