"""Which keys leave a memory tier first: `pick_victims`, a pure function of the records."""

import torch

from outcore.offload.eviction import pick_victims
from outcore.offload.residency import KeyRecord, Move, Residency, Tier


def rec(key, state=Residency.HOST, *, last_use=0, pins=0, prefetched=False, moving=False):
    r = KeyRecord(key, 4096, torch.uint8, (4096,), state, pins=pins, prefetched=prefetched, last_use=last_use)
    if moving:
        r.move = Move(state, Tier.DEVICE)
    return r


def keys(records):
    return [r.key for r in records]


def test_least_recently_used_first_and_only_from_the_tier_asked():
    records = [rec("b", last_use=5), rec("a", last_use=2), rec("d", Residency.DEVICE, last_use=1), rec("c", last_use=9)]
    assert keys(pick_victims(records, Tier.HOST)) == ["a", "b", "c"]
    assert keys(pick_victims(records, Tier.DEVICE)) == ["d"]


def test_pinned_moving_and_excluded_keys_are_never_victims():
    excluded = rec("x", last_use=0)
    records = [rec("pinned", pins=1), rec("moving", moving=True), excluded, rec("free", last_use=7)]
    assert keys(pick_victims(records, Tier.HOST, exclude=excluded)) == ["free"]


def test_unused_prefetches_go_last_and_never_for_another_prefetch():
    records = [rec("early-prefetch", last_use=1, prefetched=True), rec("old", last_use=3), rec("new", last_use=8)]
    assert keys(pick_victims(records, Tier.HOST)) == ["old", "new", "early-prefetch"]
    assert keys(pick_victims(records, Tier.HOST, for_prefetch=True)) == ["old", "new"]


def test_records_are_not_changed():
    records = [rec("a", last_use=2), rec("b", last_use=1)]
    before = [(r.key, r.state, r.pins, r.last_use) for r in records]
    pick_victims(records, Tier.HOST)
    assert [(r.key, r.state, r.pins, r.last_use) for r in records] == before
