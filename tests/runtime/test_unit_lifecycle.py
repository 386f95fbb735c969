"""The unit lifecycle's parts alone: the phase moves only along its named transitions, and the
schedules say how long a unit stays gathered."""

import pytest

from outcore.runtime.unit_lifecycle import OneMicroBatch, Phase, TrainingPhase
from outcore.runtime.vertical import VerticalBatch


class Unit:
    def __init__(self, index):
        self.index, self.views_bound = index, True


def test_the_phase_moves_along_its_transitions_and_refuses_any_other():
    phase = TrainingPhase()
    phase.begin_forward()
    assert phase.now is Phase.FORWARD
    phase.begin_backward()  # a train_batch: its forward, then its one backward
    assert phase.now is Phase.BACKWARD and phase.now.backward
    phase.end()
    phase.begin_plain_backward()
    assert phase.now is Phase.PLAIN_BACKWARD and phase.now.backward
    for wrong in (phase.begin_forward, phase.begin_backward, phase.begin_plain_backward):
        with pytest.raises(RuntimeError, match="from plain backward to .* which it never does"):
            wrong()
    assert phase.now is Phase.PLAIN_BACKWARD  # a refused move changes nothing
    phase.end()
    phase.begin_forward()
    with pytest.raises(RuntimeError, match="from forward to forward"):
        phase.begin_forward()
    with pytest.raises(RuntimeError, match="from forward to plain backward"):
        phase.begin_plain_backward()


def test_one_micro_batch_lets_each_unit_go_at_once_and_a_train_batch_after_its_last():
    plain, unit = OneMicroBatch(), Unit(3)
    assert plain.needs_views(unit) and not plain.holds("forward", unit)
    batch = VerticalBatch(3, shared_views=True)
    assert [batch.holds("forward", unit) for _ in range(3)] == [True, True, False]
    assert [batch.holds("backward", unit) for _ in range(3)] == [True, True, False]  # counted apart
    assert batch.needs_views(unit)
    batch.views_bound(unit, [])
    assert not batch.needs_views(unit)  # shared views: bound once for all micro-batches
    unit.views_bound = False  # released in between (recomputed in backward): bound again
    assert batch.needs_views(unit)
