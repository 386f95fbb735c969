"""fp32, one rank: the engine trains exactly like plain PyTorch with torch.optim.AdamW."""

import copy
import itertools
import threading

import pytest
import torch
from helpers import HP, assert_losses_match, train_engine, train_plain, twins
from models import TinyGPT, batches

import outcore
from outcore.offload import Tier

OFFLOADS = ["none", "cpu", "nvme"]


@pytest.mark.slow
@pytest.mark.parametrize("params, optim", list(itertools.product(OFFLOADS, OFFLOADS)))
def test_stage3_every_offload_combination_tied(tmp_path, params, optim):
    clip = 1.0 if (params, optim) in {("nvme", "nvme"), ("cpu", "none"), ("none", "cpu")} else None
    cfg = outcore.Config(stage=3, offload_params=params, offload_optimizer=optim, nvme_dir=str(tmp_path),
                         grad_clip=clip)
    ours_model, ref_model = twins(TinyGPT)
    data = batches(20)
    ref = train_plain(ref_model, data, clip=clip)
    ours, engine = train_engine(ours_model, cfg, data)
    assert_losses_match(ours, ref)
    sd, want = engine.full_state_dict(), ref_model.state_dict()
    assert list(sd) == list(want)
    for k in want:
        torch.testing.assert_close(sd[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    engine.close()


@pytest.mark.parametrize("params, optim, clip", [("none", "none", None), ("nvme", "nvme", 1.0),
                                                 ("cpu", "nvme", None)])
def test_stage3_untied(tmp_path, params, optim, clip):
    cfg = outcore.Config(stage=3, offload_params=params, offload_optimizer=optim, nvme_dir=str(tmp_path),
                         grad_clip=clip)
    ours_model, ref_model = twins(lambda: TinyGPT(tied=False))
    data = batches(20)
    ours, engine = train_engine(ours_model, cfg, data)
    assert_losses_match(ours, train_plain(ref_model, data, clip=clip))
    engine.close()


@pytest.mark.parametrize("stage, optim, clip", [(1, "cpu", 1.0), (1, "nvme", None), (2, "cpu", None),
                                                (2, "nvme", 1.0)])
def test_stages_1_and_2_with_optimizer_offload(tmp_path, stage, optim, clip):
    cfg = outcore.Config(stage=stage, offload_optimizer=optim, nvme_dir=str(tmp_path), grad_clip=clip)
    ours_model, ref_model = twins(TinyGPT)
    data = batches(20)
    ours, engine = train_engine(ours_model, cfg, data)
    assert_losses_match(ours, train_plain(ref_model, data, clip=clip))
    engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("clip", [None, 1.0])
def test_gradient_accumulation(tmp_path, clip):
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                         grad_accumulation=3, grad_clip=clip)
    ours_model, ref_model = twins(TinyGPT)
    data = batches(18)
    ours, engine = train_engine(ours_model, cfg, data, accum=3)
    assert_losses_match(ours, train_plain(ref_model, data, clip=clip, accum=3))
    engine.close()


@pytest.mark.parametrize("optim, clip", [("cpu", 1.0), ("nvme", None)])
def test_activation_checkpointing_refetches_correctly(tmp_path, optim, clip):
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer=optim, nvme_dir=str(tmp_path),
                         grad_clip=clip)
    ours_model, ref_model = twins(lambda: TinyGPT(checkpointing=True))
    ref_model.checkpointing = False  # the reference computes the same math without recomputation
    data = batches(10)
    ours, engine = train_engine(ours_model, cfg, data)
    assert_losses_match(ours, train_plain(ref_model, data, clip=clip))
    engine.close()


class SometimesSkips(TinyGPT):
    """Skips its middle block on odd calls: a path through the model that changes between steps."""

    calls = 0

    def forward(self, idx, targets):
        self.calls += 1
        keep = [b for i, b in enumerate(self.blocks) if not (i == 1 and self.calls % 3 == 0)]
        pos = torch.arange(idx.shape[1])
        x = self.tok(idx) + self.pos(pos)
        for b in keep:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def test_a_changed_path_is_noticed_and_stays_correct(tmp_path):
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                         prefetch_depth=2)
    ours_model, ref_model = twins(SometimesSkips)
    data = batches(12)
    ours, engine = train_engine(ours_model, cfg, data)
    assert_losses_match(ours, train_plain(ref_model, data, clip=1.0))
    s = engine.stats()
    assert s["trace_divergences"] > 0 and s["prefetch_issued"] > 0
    engine.close()


@pytest.mark.parametrize("clip", [None, 1.0])
def test_optimizer_chunks_smaller_than_units_change_nothing(tmp_path, clip):
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                         grad_clip=clip, sub_group_size=1024)
    ours_model, ref_model = twins(TinyGPT)
    data = batches(10)
    ours, engine = train_engine(ours_model, cfg, data)
    assert all(len(u.chunks) > 1 for u in engine.units)
    assert_losses_match(ours, train_plain(ref_model, data, clip=clip))
    engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize(("params", "optim"), [("nvme", "nvme"), ("cpu", "cpu"), ("nvme", "cpu"), ("cpu", "nvme")])
def test_tight_budgets_evict_and_change_nothing(tmp_path, clip, params, optim):
    """Budgets at the engine's minimum: every fetch, prefetch and write-back goes through eviction."""
    def build(**budgets):
        return outcore.Config(stage=3, offload_params=params, offload_optimizer=optim, nvme_dir=str(tmp_path),
                              grad_clip=clip, sub_group_size=2048, **budgets)

    ours_model, ref_model = twins(TinyGPT)
    probe = outcore.Engine(copy.deepcopy(ours_model), build())
    plan = probe.memory_plan()
    probe.close()
    cfg = build(device_budget=plan.device_min, host_budget=plan.host_min)
    data = batches(12)
    ours, engine = train_engine(ours_model, cfg, data)
    s = engine.stats()
    assert s["evictions"] > 0 and s["host"]["peak"] <= plan.host_min and s["device"]["peak"] <= plan.device_min
    assert_losses_match(ours, train_plain(ref_model, data, clip=clip))
    engine.close()


@pytest.mark.parametrize(("tight", "clip"), [(False, None), (True, None), (False, 1.0)])
def test_updates_read_ahead_more_chunks_where_the_host_budget_has_room(tmp_path, tight, clip):
    """[Note: optimizer read-ahead]: the optimizer thread asks for READ_AHEAD_BYTES of states
    ahead (here every chunk) under derived budgets, `prefetch_depth` chunks under the least;
    overlapped or after backward (clipping), with the same numbers."""
    def build(**budgets):
        return outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                              sub_group_size=1024, prefetch_depth=2, grad_clip=clip, **budgets)

    ours_model, ref_model = twins(TinyGPT)
    probe = outcore.Engine(copy.deepcopy(ours_model), build())
    plan = probe.memory_plan()
    probe.close()
    engine = outcore.Engine(ours_model, build(host_budget=plan.host_min) if tight else build(), outcore.AdamW(**HP))
    ahead = []  # optimizer-state chunks each prefetch of the optimizer thread asked for
    real = engine.store.prefetch

    def spy(keys, tier=Tier.DEVICE):
        keys = list(keys)
        if threading.current_thread().name.startswith("outcore-optim"):
            ahead.append(sum(".opt" in k for k in keys))
        real(keys, tier)

    engine.store.prefetch = spy
    data = batches(6)
    ours, engine = train_engine(ours_model, None, data, engine=engine)
    assert_losses_match(ours, train_plain(ref_model, data, clip=clip))
    chunks = sum(len(u.chunks) for u in engine.units)
    engine.close()
    assert plan.read_ahead_least == 2 and plan.read_ahead_ample == chunks > 8
    assert max(ahead) == 2 if tight else max(ahead) > 2


@pytest.mark.parametrize("clip", [None, 1.0])
def test_an_untied_embedding_and_head_larger_than_a_block_are_units_of_their_own(tmp_path, clip):
    """Gathered only while they run, updated as soon as their gradient is done; tied, they stay in the root."""
    big_vocab = lambda tied: TinyGPT(vocab=512, d=16, heads=2, tied=tied)  # noqa: E731 - 8192-param tables
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                         grad_clip=clip, prefetch_depth=2)
    ours_model, ref_model = twins(lambda: big_vocab(False))
    data = batches(12, vocab=512)
    ours, engine = train_engine(ours_model, cfg, data)
    assert [u.name for u in engine.units] == ["tok", "blocks.0", "blocks.1", "blocks.2", "head", "<root>"]
    assert engine.stats()["trace_divergences"] == 0
    assert_losses_match(ours, train_plain(ref_model, data, clip=clip))
    engine.close()
    tied = outcore.Engine(big_vocab(True), outcore.Config(stage=3, nvme_dir=str(tmp_path)))
    assert [u.name for u in tied.units] == ["blocks.0", "blocks.1", "blocks.2", "<root>"]
    tied.close()
