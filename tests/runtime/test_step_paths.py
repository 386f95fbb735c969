"""fp32, one rank: the paths a step's bytes take (borrowed shards, prefetch, updates beside backward,
states kept in memory, shared gradients) change nothing: the engine still trains exactly like plain
PyTorch with torch.optim.AdamW."""

import dataclasses

import pytest
import torch
from helpers import HP, assert_losses_match, train_engine, train_plain, twins
from models import TinyGPT, batches
from torch import nn

import outcore
from outcore.offload import Tier
from outcore.runtime.flat_unit import FlatUnit


def test_a_parameter_read_outside_its_units_forward_is_a_clear_error(tmp_path):
    class ReadsEmbeddingDirectly(TinyGPT):
        def forward(self, idx, targets):
            x = self.tok(idx)
            for b in self.blocks:
                x = b(x)
            logits = self.ln_f(x) @ self.tok.weight.T  # `tok` ran and was released before this
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    cfg = outcore.Config(stage=3, offload_params="cpu", nvme_dir=str(tmp_path))
    engine = outcore.Engine(ReadsEmbeddingDirectly(vocab=512, d=16, heads=2, tied=False), cfg)
    x, y = batches(1, vocab=512)[0]
    with pytest.raises(RuntimeError, match=r"tok.weight was read while its unit \(tok\) is released.*unit_classes"):
        engine(x, y)
    engine.close()
    works = outcore.Engine(ReadsEmbeddingDirectly(vocab=512, d=16, heads=2, tied=False),
                           outcore.Config(stage=3, offload_params="cpu", nvme_dir=str(tmp_path),
                                          unit_classes=("Block",)))
    works.backward(works(x, y))
    works.step()
    works.close()


def test_one_rank_gathers_a_unit_by_borrowing_its_stored_shard(tmp_path):
    """No copy: inside forward the block's flat buffer is the store's page-aligned buffer, counted in
    the DEVICE budget, and nothing is gathered beside the store."""
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                         sub_group_size=1024, grad_clip=None)
    ours_model, ref_model = twins(TinyGPT)
    engine = outcore.Engine(ours_model, cfg, outcore.AdamW(**HP))
    unit = next(u for u in engine.units if u.name == "blocks.1")
    assert len(unit.chunks) > 1  # optimizer chunks do not split the parameter key
    seen = []
    ours_model.blocks[1].register_forward_pre_hook(  # runs after the engine's, which gathers
        lambda *_: seen.append((unit.borrowed, unit.flat.untyped_storage().data_ptr() % 4096)))
    data = batches(6)
    ours, engine = train_engine(ours_model, cfg, data, engine=engine)
    assert seen == [(True, 0)] * 6
    assert engine.stats()["gathered"]["peak"] == 0 and not unit.borrowed
    assert_losses_match(ours, train_plain(ref_model, data))
    engine.close()


def test_prefetch_reads_far_ahead_into_host_and_brings_only_the_nearest_units_to_the_device(tmp_path):
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                         prefetch_depth=4)
    ours_model, ref_model = twins(lambda: TinyGPT(layers=6))
    engine = outcore.Engine(ours_model, cfg, outcore.AdamW(**HP))
    assert engine.lifecycle.device_ahead == 4  # on a CPU, DEVICE is RAM too: the whole window goes there
    # The GPU's two levels, run through the real store:
    engine.lifecycle.device_ahead = dataclasses.replace(engine.policy, device_type="cuda").device_window
    asked = []  # (tier, unit indices) of every prefetch the engine asks the real store for
    real = engine.store.prefetch

    def spy(keys, tier=Tier.DEVICE):
        keys = list(keys)  # (the optimizer's own prefetches, of its states and masters, are not the window's)
        if not any(".opt" in k for k in keys):
            asked.append((tier, [int(k.split(".")[0][1:]) for k in keys if k.endswith(".param")]))
        real(keys, tier)

    engine.store.prefetch = spy
    data = batches(4)
    ours, _ = train_engine(ours_model, cfg, data, engine=engine)
    assert_losses_match(ours, train_plain(ref_model, data, clip=1.0))
    device = [units for tier, units in asked if tier == Tier.DEVICE and units]
    host = [units for tier, units in asked if tier == Tier.HOST and units]
    assert engine.lifecycle.device_ahead == 2 and device and host
    assert max(len(u) for u in device) == 2 and max(len(u) for u in host) == 2
    # What reached HOST early is what DEVICE asks for one unit later: the window moves up a level.
    firsts = {u[0] for u in host}
    assert firsts <= {u[-1] for u in device}
    assert engine.stats()["prefetch_hit_rate"] > 0.5
    engine.close()


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_learning_rate_schedule_gives_each_step_its_own_rate(tmp_path, clip):
    # Updates may still run after step() returns (the next forward waits for them); each must use
    # the rate of the step it belongs to, not the one the loop sets next.
    rates = [3e-3 * 0.6**i for i in range(6)]
    data = batches(len(rates))
    ours_model, ref_model = twins(TinyGPT)
    opt = torch.optim.AdamW(ref_model.parameters(), **HP)
    ref = []
    for lr, (x, y) in zip(rates, data, strict=True):
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        loss = ref_model(x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip)
        opt.step()
        ref.append(loss.item())
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                         grad_clip=clip)
    engine = outcore.Engine(ours_model, cfg, outcore.AdamW(**HP))
    ours = []
    for lr, (x, y) in zip(rates, data, strict=True):
        engine.lr = lr
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        ours.append(loss.item())
    assert_losses_match(ours, ref)
    engine.close()


@pytest.mark.parametrize("accum", [1, 2])
def test_overlapped_updates_take_one_micro_steps_gradient_in_memory(tmp_path, accum):
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                         grad_accumulation=accum, grad_clip=None)
    ours_model, ref_model = twins(TinyGPT)
    engine = outcore.Engine(ours_model, cfg, outcore.AdamW(**HP))
    staged = []
    real = engine.store.stage

    def spy(key, *args, **kwargs):
        staged.append(key)
        return real(key, *args, **kwargs)

    engine.store.stage = spy
    data = batches(4 * accum)
    ours, _ = train_engine(ours_model, cfg, data, accum=accum, engine=engine)
    assert_losses_match(ours, train_plain(ref_model, data, accum=accum))
    grads = [k for k in staged if ".grad" in k]
    # One micro-step: no gradient is copied into the store. Accumulating ones must be kept there.
    assert (len(grads) == 0) if accum == 1 else (len(grads) > 0), grads[:3]
    engine.close()


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_host_budget_holding_every_optimizer_state_keeps_them_off_the_disk(tmp_path, clip):
    data = batches(6)
    ref = train_plain(twins(TinyGPT)[1], data, clip=clip)
    written = {}
    for roomy in (False, True):
        ours_model, _ = twins(TinyGPT)
        cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", grad_clip=clip,
                             nvme_dir=str(tmp_path / str(roomy)), host_budget=(64 << 20) if roomy else None)
        engine = outcore.Engine(ours_model, cfg, outcore.AdamW(**HP))
        plan = engine.memory_plan()
        assert plan.keeps_optimizer_states(engine.stats()["host"]["budget"]) is roomy
        ours, _ = train_engine(ours_model, cfg, data[:2], engine=engine)
        engine.synchronize()
        engine.store.flush()  # write-backs run behind the updates: count whole steps' worth
        before = engine.stats()["bytes_written"]
        more, _ = train_engine(ours_model, cfg, data[2:], engine=engine)
        engine.synchronize()
        engine.store.flush()
        written[roomy] = engine.stats()["bytes_written"] - before
        assert_losses_match(ours + more, ref)
        opt_keys = [c.opt_key for u in engine.units for c in u.chunks]
        in_ram = [k for k in opt_keys if engine.store.ram_tier_of(k) is not None]
        # The default budget keeps those of the units the forward runs first (runtime/memory_plan.py
        # [Note: kept optimizer states]), the root's and the first block's, and streams the rest.
        entry = [c.opt_key for i in plan.entry for c in engine.units[i].chunks]
        assert sorted(in_ram) == sorted(opt_keys if roomy else entry)
        engine.close()
    # The default budget writes the streamed states back each step; a roomy one writes nothing once warm.
    streamed = plan.optimizer_states - plan.entry_states
    assert written[False] >= 4 * streamed and written[True] == 0, written


class SumOfTwo(nn.Module):
    """Two weights read only as their sum: autograd hands both of them the very same gradient tensor."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(d, d) * 0.1)
        self.b = nn.Parameter(torch.randn(d, d) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(x @ (self.a + self.b))


class AliasedGradients(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(SumOfTwo(d) for _ in range(3))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@pytest.mark.parametrize("clip, accum", [(None, 1), (1.0, 1), (None, 2)])
def test_gradients_shared_by_two_parameters_are_read_never_written(tmp_path, clip, accum):
    """The engine takes the parameters' own gradient tensors, which may alias (here a and b share
    one): scaling or accumulating them in place would change both parameters' updates."""
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                         grad_clip=clip, grad_accumulation=accum, sub_group_size=1500)
    ours_model, ref_model = twins(AliasedGradients)
    data = batches(8 * accum)
    ours, engine = train_engine(ours_model, cfg, data, accum=accum)
    assert_losses_match(ours, train_plain(ref_model, data, clip=clip, accum=accum))
    for name, p in ref_model.state_dict().items():
        torch.testing.assert_close(engine.full_state_dict()[name], p, rtol=1e-5, atol=1e-6, msg=name)
    engine.close()


def test_one_rank_updates_from_autograds_own_gradients_without_copying_them(tmp_path, monkeypatch):
    """One rank, fp32, one micro-step: the update reads each parameter's gradient where autograd
    left it; no flat gradient is assembled (runtime/flat_unit.py [Note: unit gradients])."""
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                         grad_clip=None)
    ours_model, ref_model = twins(TinyGPT)
    engine = outcore.Engine(ours_model, cfg, outcore.AdamW(**HP))
    shared = []
    real = FlatUnit.gradient_pieces

    def spy(self, grads, factor, *, keep):
        pieces = real(self, grads, factor, keep=keep)
        owners = {g.untyped_storage().data_ptr() for g in grads if g is not None}
        for chunk, parts in zip(self.chunks, pieces, strict=True):
            start = chunk.start
            for piece in parts:
                if start < self.layout.numel:  # the padding after the parameters is zeros of its own
                    shared.append(piece.untyped_storage().data_ptr() in owners)
                start += piece.numel()
            assert start == chunk.end
        return pieces

    monkeypatch.setattr(FlatUnit, "gradient_pieces", spy)
    data = batches(4)
    ours, _ = train_engine(ours_model, cfg, data, engine=engine)
    assert_losses_match(ours, train_plain(ref_model, data))
    assert shared and all(shared), shared
    engine.close()


@pytest.mark.parametrize("clip", [None, 1.0])
def test_every_forward_prefetches_the_units_ahead_once_their_updates_are_done(tmp_path, clip):
    # A finished update stays in the engine's pending table until its unit is gathered again; the
    # forward's prefetch must not take that for an update still running (it once skipped every unit).
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                         grad_clip=clip, prefetch_depth=2)
    ours_model, ref_model = twins(lambda: TinyGPT(layers=4))
    engine = outcore.Engine(ours_model, cfg, outcore.AdamW(**HP))
    in_forward, asked = [False], []  # param keys the engine asked the store to prefetch, per forward
    real = engine.store.prefetch

    def spy(keys, tier=Tier.DEVICE):
        keys = list(keys)
        if in_forward[0]:
            asked[-1].update(k for k in keys if k.endswith(".param"))
        real(keys, tier)

    engine.store.prefetch = spy
    data, losses = batches(4), []
    for x, y in data:
        for update in engine.updates.in_flight():  # done, and left in the table
            update.outcome()
        asked.append(set())
        in_forward[0] = True
        loss = engine(x, y)
        in_forward[0] = False
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    first = engine.trace.recorded["forward"][0]
    ahead = {u.param_key for u in engine.units if u.index != first and not u.resident}
    assert len(ahead) >= 4 and asked[0] == set()  # the first step records the order
    assert asked[1:] == [ahead] * 3
    assert_losses_match(losses, train_plain(ref_model, data, clip=clip))
    engine.close()


@pytest.mark.parametrize("clip", [None, 1.0])
def test_updated_parameters_stay_in_memory_for_the_next_forward(tmp_path, clip):
    # [Note: updated parameters stay put]: with DEVICE room for every parameter shard and a HOST
    # budget that holds little more than the optimizer's stream, an update leaves each shard where
    # it was, so the next forward reads nothing from NVMe (moved to HOST, each was written out and
    # read back every step).
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                         grad_clip=clip, device_budget=4 << 20, host_budget=96 << 10, sub_group_size=1024)
    ours_model, ref_model = twins(lambda: TinyGPT(layers=4, tied=False))
    engine = outcore.Engine(ours_model, cfg, outcore.AdamW(**HP))
    data, losses, forward_reads = batches(4), [], []
    for x, y in data:
        engine.synchronize()  # the last step's updates (and their write-backs) are done
        before = engine.stats()["bytes_read"]
        loss = engine(x, y)
        forward_reads.append(engine.stats()["bytes_read"] - before)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert forward_reads[0] > 0  # what put() first wrote to NVMe
    assert forward_reads[1:] == [0, 0, 0]
    assert engine.stats()["bytes_written"] > 0  # optimizer states still stream through NVMe
    assert_losses_match(losses, train_plain(ref_model, data, clip=clip))
    engine.close()
