"""Issue 71, item 1: what autograd saves outside the checkpointed units pages through the store
(`Config.offload_activations`), in `engine(...)` + `backward` and in `train_batch`, and a paged run
computes what an unpaged one does, bit for bit."""

import json
import os
import subprocess
import sys

import pytest
import torch
from launch import torchrun
from models import TinyGPT, batches

import outcore
from outcore.runtime import saved_activations

HERE = os.path.dirname(__file__)


def engine_for(tmp_path, name, mode, *, accum=2, **kw):
    torch.manual_seed(0)
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / name),
                         grad_accumulation=accum, sub_group_size=4096, offload_activations=mode, **kw)
    return outcore.Engine(TinyGPT(d=64, vocab=128, tied=False, checkpointing=True), cfg, outcore.AdamW(lr=1e-2))


def plain_steps(engine, data):
    losses, paged = [], []
    for i in range(0, len(data), 2):
        for x, y in data[i:i + 2]:
            loss = engine(x, y)
            engine.backward(loss)
            losses.append(loss.detach())
        engine.step()
        paged.append(engine.stats()["activations"])
    return losses, paged


def assert_bit_equal(a, b):
    for (k, v), (k2, w) in zip(a.full_state_dict().items(), b.full_state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, w), k


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_engine_call_pages_block_inputs_and_trains_bit_for_bit(tmp_path, monkeypatch, mode):
    monkeypatch.setattr(saved_activations, "PAGED_BYTES", 1 << 10)
    data = batches(6, batch=2, vocab=128)
    ref, ours = engine_for(tmp_path, "ref", "none"), engine_for(tmp_path, "ours", mode)
    ref_losses, ref_paged = plain_steps(ref, data)
    losses, paged = plain_steps(ours, data)
    assert [float(v) for v in losses] == [float(v) for v in ref_losses]
    assert_bit_equal(ref, ours)
    assert all(p["bytes_paged"] == 0 for p in ref_paged)
    # two micro-batches a step, each keeps its 3 block inputs, the final norm's input and the log-softmax
    per_micro = 2 * 16 * (4 * 64 + 128) * 4
    assert all(p["bytes_paged"] >= 2 * per_micro for p in paged)
    if mode == "nvme":  # written as they were saved, read back in backward (the last ones may still be in HOST)
        assert all(0 < p["bytes_from_nvme"] <= p["bytes_paged"] for p in paged)
    assert not [k for k in ours.store.keys() if k.startswith("act.")]
    ref.close()
    ours.close()


def test_auto_keeps_in_place_what_fits_and_pages_the_rest(tmp_path, monkeypatch):
    """`auto` keeps a pass's saved tensors in place up to half the free memory; past it, they page."""
    monkeypatch.setattr(saved_activations, "PAGED_BYTES", 1 << 10)
    data = batches(2, batch=2, vocab=128)
    roomy = engine_for(tmp_path, "roomy", "auto")
    _, paged = plain_steps(roomy, data)
    assert paged[0]["bytes_paged"] == 0 and paged[0]["bytes_kept"] > 0
    from outcore.runtime import activation_paging
    monkeypatch.setattr(activation_paging, "free_memory", lambda device: 2 * 20_000)  # room for 20 kB in place
    short = engine_for(tmp_path, "short", "auto")
    losses, paged = plain_steps(short, data)
    assert 0 < paged[0]["bytes_kept"] <= 2 * 20_000 and paged[0]["bytes_paged"] > 0
    assert_bit_equal(roomy, short)
    roomy.close()
    short.close()


def test_a_graph_dropped_without_backward_deletes_its_keys(tmp_path, monkeypatch):
    monkeypatch.setattr(saved_activations, "PAGED_BYTES", 1 << 10)
    engine = engine_for(tmp_path, "e", "cpu", accum=1)
    x, y = batches(1, batch=2, vocab=128)[0]
    loss = engine(x, y)
    assert [k for k in engine.store.keys() if k.startswith("act.")]
    del loss  # evaluation under grad, say: nothing will take them back
    assert not [k for k in engine.store.keys() if k.startswith("act.")]
    engine.close()


def test_a_tensor_saved_by_every_block_is_paged_once(tmp_path, monkeypatch):
    """A table every block reads (rotary cos/sin, a mask) is saved by each block's checkpoint: one key."""
    monkeypatch.setattr(saved_activations, "PAGED_BYTES", 1 << 10)

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))

        def forward(self, x):
            table = torch.randn(64, 64)
            for b in self.blocks:
                x = torch.utils.checkpoint.checkpoint(lambda h, t, b=b: b(h) @ t, x, table, use_reentrant=False)
            return x.square().mean()

    torch.manual_seed(0)
    engine = outcore.Engine(Shared(), outcore.Config(stage=3, offload_activations="cpu", host_budget=1 << 20,
                                                               unit_classes=("Linear",)))
    engine.backward(engine(torch.randn(8, 64)))
    engine.step()
    # four block inputs of 8 x 64, the loss's input (square saves it) and the table once, all fp32
    assert engine.stats()["activations"]["bytes_paged"] == 5 * 8 * 64 * 4 + 64 * 64 * 4
    engine.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_train_batch_pages_as_asked_bit_for_bit(tmp_path, monkeypatch, mode):
    monkeypatch.setattr(saved_activations, "PAGED_BYTES", 1 << 10)
    data = batches(4, batch=2, vocab=128)
    ref, ours = engine_for(tmp_path, "ref", "none", accum=1), engine_for(tmp_path, "ours", mode, accum=1)
    for i in (0, 2):
        assert ref.train_batch(data[i:i + 2])["losses"] == ours.train_batch(data[i:i + 2])["losses"]
        assert ref.stats()["activations"]["bytes_paged"] == 0 < ours.stats()["activations"]["bytes_paged"]
    assert_bit_equal(ref, ours)
    ref.close()
    ours.close()


def test_nvme_activations_need_a_directory():
    with pytest.raises(ValueError, match="nvme_dir is required when .*offload_activations"):
        outcore.Config(offload_activations="nvme")
    with pytest.raises(ValueError, match="offload_activations='disk': use one of auto, none, cpu, nvme"):
        outcore.Config(offload_activations="disk")


@pytest.mark.slow
@pytest.mark.parametrize("path", ["plain", "batch"])
def test_two_ranks_page_bit_for_bit(tmp_path, path):
    results = {}
    for mode in ("none", "nvme"):
        out = str(tmp_path / f"{mode}.json")
        cfg = {"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_dir": str(tmp_path / mode),
               "sub_group_size": 1024, "offload_activations": mode, "grad_accumulation": 2 if path == "plain" else 1}
        cmd = [*torchrun(2, tmp_path), os.path.join(HERE, "dist_paged_activations.py"), out, json.dumps(cfg), path]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        results[mode] = json.load(open(out)), torch.load(out + ".pt", weights_only=True)
    (ref, ref_sd), (got, got_sd) = results["none"], results["nvme"]
    assert got["world"] == 2 and got["losses"] == ref["losses"] and not got["left"]
    assert all(0 < p["bytes_from_nvme"] <= p["bytes_paged"] for p in got["paged"])
    assert all(p["bytes_paged"] == 0 for p in ref["paged"])
    for k, v in ref_sd.items():
        assert torch.equal(got_sd[k], v), k


@pytest.mark.slow
def test_activations_past_the_budgets_train_within_them(tmp_path):
    """512 MiB of block inputs under a 96 MiB HOST budget: paged, the step's peak RSS grows by the
    budget and a few blocks' worth (measured 151 MiB), where kept it grows by all of them (583 MiB)."""
    grown = {}
    for mode in ("none", "nvme"):
        res = subprocess.run([sys.executable, os.path.join(HERE, "memory_activations.py"), str(tmp_path / mode), mode],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        got = json.loads(res.stdout.strip().splitlines()[-1])
        grown[mode] = got["grown"]
        if mode == "nvme":
            assert got["activations"]["bytes_paged"] >= 32 * (16 << 20)
            assert got["activations"]["bytes_from_nvme"] >= 24 * (16 << 20)
    assert grown["none"] > 500 << 20, grown
    assert grown["nvme"] < (96 << 20) + 6 * (16 << 20), grown


def test_a_run_with_its_states_in_memory_pages_what_it_is_asked_to(tmp_path, monkeypatch):
    """Nothing offloaded: the derived HOST budget holds the states' few bytes, and gets room for the
    activations asked to page (runtime/activation_paging.py host_share), which then page."""
    monkeypatch.setattr(saved_activations, "PAGED_BYTES", 1 << 10)
    data = batches(2, batch=2, vocab=128)
    engines = {}
    for mode in ("none", "nvme"):
        torch.manual_seed(0)
        cfg = outcore.Config(stage=3, nvme_dir=str(tmp_path / mode), grad_accumulation=2, offload_activations=mode)
        engines[mode] = outcore.Engine(TinyGPT(d=64, vocab=128, tied=False, checkpointing=True), cfg,
                                       outcore.AdamW(lr=1e-2))
    (_, kept), (_, paged) = plain_steps(engines["none"], data), plain_steps(engines["nvme"], data)
    assert kept[0]["bytes_paged"] == 0 < paged[0]["bytes_paged"] and paged[0]["bytes_kept"] == 0
    assert_bit_equal(engines["none"], engines["nvme"])
    for engine in engines.values():
        engine.close()
