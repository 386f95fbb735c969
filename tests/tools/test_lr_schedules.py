"""`outcore train`'s schedules against transformers' own: the same rate at every update."""

import pytest
import torch

from outcore.tools.lr_schedules import SCHEDULES, Schedule, default_warmup, warmup_steps

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("steps, warmup", [(40, 0), (40, 7), (25, 24)])
def test_each_schedule_gives_transformers_rates(name, steps, warmup):
    peak = 3e-4
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    extra = {"min_lr_rate": 0.1} if name == "cosine_with_min_lr" else {}
    scheduler = transformers.get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=steps,
                                           scheduler_specific_kwargs=extra)
    ours = Schedule(name, steps, warmup, peak, **extra)
    for step in range(steps + 2):  # past the end too
        assert ours.rate(step) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12, abs=1e-15), step
        optimizer.step()
        scheduler.step()


def test_warmup_is_read_as_the_trainer_reads_it():
    assert warmup_steps(100, 5, None) == 5
    assert warmup_steps(100, None, 0.03) == 3 and warmup_steps(101, None, 0.03) == 4  # rounded up
    assert warmup_steps(300, None, None) == default_warmup(300) == 30
    with pytest.raises(ValueError, match="give one"):
        warmup_steps(100, 5, 0.1)
    with pytest.raises(ValueError, match="--lr-scheduler 'cosine_annealing'"):
        Schedule("cosine_annealing", 10, 0, 1e-3)
