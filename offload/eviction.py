"""Which released keys leave a memory tier first when a move needs room: a pure function."""

from __future__ import annotations

from collections.abc import Iterable

from outcore.offload.residency import STABLE, KeyRecord, Tier


def pick_victims(records: Iterable[KeyRecord], tier: Tier, *, exclude: KeyRecord | None = None,
                 for_prefetch: bool = False) -> list[KeyRecord]:
    """The keys resting in `tier` that may be evicted, in the order to evict them.

    Only released keys at rest qualify (not pinned, not moving, not `exclude`). Least recently used
    go first, except that:
    - keys visiting the tier go before keys put there (their `home`), and a prefetch evicts
      visitors only: a visitor is on its way back anyway, while a key that lives here was placed
      here by choice (the optimizer states a host budget keeps, runtime/memory_plan.py [Note: kept
      optimizer states]), and a guess at what comes next does not displace it;
    - keys prefetched and not yet used go last, and never to make room for another prefetch:
      prefetches are issued in the order they will be used, so the older one is wanted sooner
      (evicting it read every optimizer chunk twice, once ahead and once on demand).
    """
    state = STABLE[tier]
    victims = [r for r in records if r.state == state and r.pins == 0 and r.move is None
               and r is not exclude and not (for_prefetch and (r.prefetched or r.home == tier))]
    return sorted(victims, key=lambda r: (r.prefetched, r.home == tier, r.last_use))
