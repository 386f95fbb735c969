"""Overlapped updates that trail backward, as on a GPU whose backward outruns AdamW on the CPU:
backward waits for them, so their gradients never push the optimizer states out of the host budget."""

import dataclasses
import logging
import threading
import time

import pytest
from helpers import assert_losses_match, train_engine, train_plain, twins
from models import TinyGPT, batches

import outcore
from outcore.runtime import update_stream
from outcore.runtime.memory_plan import UnitShape, plan_memory
from outcore.runtime.policy import HANDED_OVER, StatePolicy


@pytest.fixture
def gpu_like_updates(monkeypatch):
    """Gradients go through the store, as a GPU's do to a HOST work tier (a CPU hands its over in
    memory), and each update takes far longer than the backward of a unit. Records how many
    updates ran at once behind backward."""
    monkeypatch.setattr(StatePolicy, "hands_over_window", lambda self, micro_steps, speculating=False: False)
    real = update_stream.update_chunks
    seen = {"most": 0}
    lock = threading.Lock()

    def slow(*args, **kwargs):
        time.sleep(0.03)
        return real(*args, **kwargs)

    real_overlap = update_stream.UpdateStream.overlap

    def overlap(self, unit, *args, **kwargs):
        real_overlap(self, unit, *args, **kwargs)
        with lock:
            seen["most"] = max(seen["most"], sum(not f.done() for f in self._pending.values()))

    monkeypatch.setattr(update_stream, "update_chunks", slow)
    monkeypatch.setattr(update_stream.UpdateStream, "overlap", overlap)
    return seen


@pytest.mark.slow
def test_states_on_the_cpu_stay_there_when_updates_trail_backward(tmp_path, gpu_like_updates):
    cfg = outcore.Config(stage=3, offload_params="cpu", offload_optimizer="cpu", nvme_dir=str(tmp_path),
                         grad_clip=None)
    ours_model, ref_model = twins(lambda: TinyGPT(layers=8))
    data = batches(4)
    ours, engine = train_engine(ours_model, cfg, data)
    engine.synchronize()
    stats = engine.stats()
    assert stats["bytes_read"] == 0 and stats["bytes_written"] == 0  # nothing went to the swap file
    assert gpu_like_updates["most"] <= HANDED_OVER
    assert_losses_match(ours, train_plain(ref_model, data))
    engine.close()


def test_the_plan_counts_the_gradients_of_the_updates_backward_waits_for():
    """A GPU with a HOST work tier: HANDED_OVER units' gradients wait in the store for their
    updates while backward puts the next one's; a window of several micro-steps keeps every unit's
    gradient until its last one."""
    gpu = StatePolicy(world=1, stage=3, offload_params="cpu", offload_optimizer="cpu", dtype="bf16",
                      device_type="cuda", prefetch_depth=2, sub_group_size=1 << 22, clipping=False)
    assert gpu.overlapped and not gpu.hands_over
    units = [UnitShape(1 << 20, 1 << 20, False, i == 3, i) for i in range(4)]
    one_unit = 4 << 20  # the fp32 gradient of one unit's shard
    waited = plan_memory(units, gpu).host.runtime
    accumulating = plan_memory(units, dataclasses.replace(gpu, grad_accumulation=2)).host.runtime
    assert accumulating - waited == (len(units) - HANDED_OVER - 1) * one_unit


def test_keys_the_config_keeps_in_memory_that_spill_to_the_swap_file_are_said_once(tmp_path, caplog):
    """The least host budget holds the parameters and optimizer states, not every gradient beside
    them as well: some keys go to the swap file, and the updates after backward (clipping) stream
    chunk by chunk through what is left."""
    model = TinyGPT(layers=8)
    cfg = outcore.Config(stage=3, offload_params="cpu", offload_optimizer="cpu", nvme_dir=str(tmp_path),
                         grad_clip=1.0)
    planned = outcore.Engine(model, cfg, outcore.AdamW(lr=1e-3))
    plan = planned.memory_plan()
    planned.close()
    tight = dataclasses.replace(cfg, host_budget=plan.host_min)
    ours_model, ref_model = twins(lambda: TinyGPT(layers=8))
    data = batches(4)
    with caplog.at_level(logging.WARNING, logger="outcore"):
        ours, engine = train_engine(ours_model, tight, data)
    engine.synchronize()
    said = [r for r in caplog.records if "could not hold what this config keeps in memory" in r.getMessage()]
    assert engine.stats()["bytes_written"] > 0 and len(said) == 1
    assert_losses_match(ours, train_plain(ref_model, data, clip=1.0))
    engine.close()


def test_nothing_is_said_where_everything_fits_or_nvme_was_asked_for(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="outcore"):
        for params, optim in [("cpu", "cpu"), ("nvme", "nvme")]:
            cfg = outcore.Config(stage=3, offload_params=params, offload_optimizer=optim,
                                 nvme_dir=str(tmp_path / params), grad_clip=1.0)
            _, engine = train_engine(TinyGPT(layers=4), cfg, batches(2))
            engine.close()
    assert "could not hold" not in caplog.text


def test_gradients_accumulated_over_micro_steps_stay_in_the_derived_host_budget(tmp_path, caplog):
    cfg = outcore.Config(stage=3, offload_params="cpu", offload_optimizer="cpu", nvme_dir=str(tmp_path),
                         grad_clip=None, grad_accumulation=4)
    ours_model, ref_model = twins(lambda: TinyGPT(layers=8))
    data = batches(8)
    with caplog.at_level(logging.WARNING, logger="outcore"):
        ours, engine = train_engine(ours_model, cfg, data, accum=4)
    engine.synchronize()
    stats = engine.stats()
    assert stats["bytes_read"] == 0 and stats["bytes_written"] == 0
    assert "could not hold" not in caplog.text
    assert_losses_match(ours, train_plain(ref_model, data, accum=4))
    engine.close()
