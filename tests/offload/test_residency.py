"""The residency state machine: the legal-transition table and the record that enforces it."""

import itertools

import pytest
import torch

from outcore.offload.residency import LEGAL, MOVING, STABLE, KeyRecord, Residency, Tier

STABLE_STATES = set(STABLE.values())
MOVING_STATES = set(MOVING.values())


def test_every_state_has_a_row_and_no_state_goes_to_itself():
    assert set(LEGAL) == set(Residency)
    assert all(state not in targets for state, targets in LEGAL.items())


def test_a_move_starts_from_a_stable_state_and_ends_in_one():
    for state, targets in LEGAL.items():
        if state in MOVING_STATES:
            assert targets <= STABLE_STATES, f"{state} may only land or roll back"
    # NVME is left only by a move into memory: bytes come from the swap file through a read.
    assert LEGAL[Residency.NVME] == {Residency.TO_HOST, Residency.TO_DEVICE}
    # A move into a tier ends there, or rolls back to where it may have started.
    assert Residency.HOST in LEGAL[Residency.TO_HOST] and Residency.DEVICE in LEGAL[Residency.TO_DEVICE]
    assert Residency.NVME in LEGAL[Residency.TO_NVME]


def test_memory_tiers_may_drop_a_clean_copy_or_hand_over_without_moving_state():
    for tier in (Tier.HOST, Tier.DEVICE):
        assert Residency.NVME in LEGAL[STABLE[tier]]  # a clean copy is dropped
        assert MOVING[Tier.NVME] in LEGAL[STABLE[tier]]  # a dirty one is written back
    assert Residency.DEVICE in LEGAL[Residency.HOST] and Residency.HOST in LEGAL[Residency.DEVICE]


def record(state: Residency) -> KeyRecord:
    return KeyRecord("k", 4, torch.float32, (1,), state)


R = Residency
# The design's moves, written out here rather than read from LEGAL: a wrong table fails.
DESIGNED = {
    (R.NVME, R.TO_HOST), (R.NVME, R.TO_DEVICE),  # read from the swap file
    (R.HOST, R.TO_DEVICE), (R.HOST, R.TO_NVME),  # promoted; written back
    (R.DEVICE, R.TO_HOST), (R.DEVICE, R.TO_NVME),  # demoted; written back
    (R.HOST, R.NVME), (R.DEVICE, R.NVME),  # a clean copy dropped
    (R.HOST, R.DEVICE), (R.DEVICE, R.HOST),  # a CPU-only hand-over: one RAM, two budgets
    (R.TO_HOST, R.HOST), (R.TO_DEVICE, R.DEVICE), (R.TO_NVME, R.NVME),  # landed
    (R.TO_HOST, R.NVME), (R.TO_HOST, R.DEVICE),  # failed: back where it started
    (R.TO_DEVICE, R.NVME), (R.TO_DEVICE, R.HOST),
    (R.TO_NVME, R.HOST), (R.TO_NVME, R.DEVICE),
}


@pytest.mark.parametrize(("start", "end"), list(itertools.product(Residency, Residency)))
def test_the_record_changes_state_only_along_the_designed_moves(start, end):
    rec = record(start)
    if (start, end) in DESIGNED:
        rec.to(end)
        assert rec.state is end
    else:
        with pytest.raises(AssertionError, match="illegal residency change"):
            rec.to(end)
        assert rec.state is start


def test_tier_of_a_record_is_known_only_at_rest():
    assert record(Residency.HOST).tier is Tier.HOST and record(Residency.HOST).stable_tier is Tier.HOST
    moving = record(Residency.TO_DEVICE)
    assert moving.tier is None
    with pytest.raises(AssertionError, match="moving"):
        _ = moving.stable_tier
    with pytest.raises(AssertionError, match="no bytes in memory"):
        _ = record(Residency.NVME).held
