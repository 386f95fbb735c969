"""Optimizer states in bf16 (`Config.state_dtype="bf16"`): stored in half the bytes, updated in fp32 and
rounded stochastically; a checkpoint records its state dtype, resumes exactly, and loads into the other
dtype converted, saying so."""

import logging
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from helpers import train_engine  # noqa: E402
from models import TinyGPT, batches  # noqa: E402

import outcore  # noqa: E402
from outcore.offload import Tier  # noqa: E402
from outcore.runtime.memory_plan import plan_memory  # noqa: E402
from outcore.runtime.policy import StatePolicy  # noqa: E402
from outcore.runtime.stochastic_rounding import StochasticRounding  # noqa: E402


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    rounding = StochasticRounding(seed=0)
    for value in (1.0 + 1 / 512 + 1 / 4096, -3.3e-5, 7.77e3):
        x = torch.full((200_000,), value)
        out = torch.empty_like(x, dtype=torch.bfloat16)
        rounding.round_into(out, x)
        bits = x[:1].view(torch.int32) & -65536  # the bf16 below in magnitude, and the one above it
        neighbours = {bits.view(torch.float32).item(), (bits + 65536).view(torch.float32).item()}
        assert set(out.float().unique().tolist()) == neighbours
        assert out.float().mean().item() == pytest.approx(value, rel=2e-4)  # nearest is off by up to 4e-3
    exact = torch.tensor([1.0, -2.5, 0.0, 3.140625])  # representable in bf16: never moved
    out = torch.empty_like(exact, dtype=torch.bfloat16)
    rounding.round_into(out, exact)
    assert torch.equal(out.float(), exact)


def train(engine: outcore.Engine, data) -> list[float]:
    """A forward, backward and step per batch; the losses."""
    return train_engine(None, None, data, engine=engine)[0]


def run(tmp_path, state_dtype: str, offload: str = "nvme", dtype: str = "fp32", steps: int = 12):
    torch.manual_seed(0)
    cfg = outcore.Config(state_dtype=state_dtype, dtype=dtype, offload_params=offload, offload_optimizer=offload,
                         nvme_dir=str(tmp_path / f"nvme-{state_dtype}-{offload}-{dtype}"))
    engine = outcore.Engine(TinyGPT(), cfg, outcore.AdamW(lr=1e-3))
    return engine, train(engine, batches(steps))


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_bf16_states_train_as_fp32_states_do_and_are_stored_in_bf16(tmp_path, offload):
    engine, bf16 = run(tmp_path, "bf16", offload)
    unit = engine.units[0]
    tier = Tier.DEVICE if offload == "none" else Tier.HOST
    state = engine.store.fetch_now(unit.chunks[0].opt_key, tier)
    # [m|v]: the fp32 parameters are the masters
    assert state.dtype == torch.bfloat16 and state.numel() == 2 * unit.chunks[0].numel
    engine.store.release(unit.chunks[0].opt_key)
    engine.close()
    fp32_engine, fp32 = run(tmp_path, "fp32", offload)
    fp32_engine.close()
    assert bf16[0] == fp32[0] and bf16 != fp32  # the first step's loss comes before any update
    assert bf16 == pytest.approx(fp32, rel=2e-3)


def test_bf16_compute_keeps_its_parameters_as_the_master(tmp_path):
    engine, losses = run(tmp_path, "bf16", "cpu", dtype="bf16")
    unit = engine.units[0]
    assert unit.master_is_param
    state = engine.store.fetch_now(unit.chunks[0].opt_key, Tier.HOST)
    assert state.dtype == torch.bfloat16 and state.numel() == 2 * unit.chunks[0].numel
    engine.store.release(unit.chunks[0].opt_key)
    engine.close()
    fp32_engine, fp32_states = run(tmp_path, "fp32", "cpu", dtype="bf16")
    fp32_engine.close()
    assert losses == pytest.approx(fp32_states, rel=3e-2)  # bf16 compute's own noise is of that order


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_memory_plan_counts_half_the_optimizer_bytes(dtype):
    units = []
    from outcore.runtime.memory_plan import unit_shapes

    def states(state_dtype: str) -> int:
        policy = StatePolicy(world=1, stage=3, offload_params="nvme", offload_optimizer="nvme", dtype=dtype,
                             device_type="cpu", prefetch_depth=2, sub_group_size=1 << 20, clipping=True,
                             state_dtype=state_dtype)
        units[:] = unit_shapes([4 << 20] * 4 + [1 << 20], policy)
        return plan_memory(units, policy).optimizer_states

    fp32, bf16 = states("fp32"), states("bf16")
    # fp32 compute: [m|v] 8 bytes a parameter against 4; bf16 compute: [master|m|v] 12 against [m|v] 4
    assert bf16 * (2 if dtype == "fp32" else 3) == fp32


@pytest.mark.slow
def test_a_bf16_checkpoint_resumes_exactly_and_converts_both_ways(tmp_path, caplog):
    data = batches(8)

    def make(state_dtype: str) -> outcore.Engine:
        torch.manual_seed(0)
        cfg = outcore.Config(state_dtype=state_dtype, offload_params="nvme", offload_optimizer="nvme",
                             nvme_dir=str(tmp_path / f"nvme-{state_dtype}"))
        return outcore.Engine(TinyGPT(), cfg, outcore.AdamW(lr=1e-3))

    for saved in ("bf16", "fp32"):
        engine = make(saved)
        train(engine, data[:4])
        engine.save_checkpoint(str(tmp_path / "ckpt"), saved)
        states = {k: v.clone() for k, v in engine.full_state_dict().items()}
        uninterrupted = train(engine, data[4:])
        engine.close()
        for into in ("bf16", "fp32"):
            engine = make(into)
            with caplog.at_level(logging.WARNING):
                caplog.clear()
                meta = engine.load_checkpoint(str(tmp_path / "ckpt"), saved)
            assert meta["state_dtype"] == saved
            said = [r.message for r in caplog.records if "kept its optimizer states" in r.message]
            assert len(said) == (saved != into)
            assert all(torch.equal(v, states[k]) for k, v in engine.full_state_dict().items())  # fp32 parameters
            resumed = train(engine, data[4:])
            engine.close()
            if saved == into:
                assert resumed == uninterrupted  # the rounding's generator resumes too
            else:
                assert resumed == pytest.approx(uninterrupted, rel=2e-3)


def test_train_takes_state_dtype(tmp_path, monkeypatch):
    import json

    from outcore.runtime.checkpoint.folder import find_checkpoint, read_meta
    from outcore.tools.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--steps", "2", "--batch", "1", "--seq", "16", "--eval-batches", "1",
                 "--state-dtype", "bf16", "--json", "run.json"]) == 0
    assert json.loads((tmp_path / "run.json").read_text())["config"]["state_dtype"] == "bf16"
    assert read_meta(find_checkpoint(str(tmp_path / "outcore-run" / "checkpoints")))["state_dtype"] == "bf16"


def test_an_unknown_state_dtype_is_refused():
    with pytest.raises(ValueError, match="state_dtype='fp16': use one of fp32, bf16"):
        outcore.Config(state_dtype="fp16")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_bf16_states_under_half_precision_compute(tmp_path, dtype):
    """fp16 keeps a master apart, [master|m|v] in bf16; bf16 compute's parameters are the master."""
    engine, bf16 = run(tmp_path, "bf16", "nvme", dtype=dtype)
    unit = engine.units[0]
    assert unit.master_is_param == (dtype == "bf16")
    state = engine.store.fetch_now(unit.chunks[0].opt_key, Tier.HOST)
    assert state.dtype == torch.bfloat16 and state.numel() == (2 if dtype == "bf16" else 3) * unit.chunks[0].numel
    engine.store.release(unit.chunks[0].opt_key)
    engine.close()
    fp32_engine, fp32 = run(tmp_path, "fp32", "nvme", dtype=dtype)
    fp32_engine.close()
    assert bf16 == pytest.approx(fp32, rel=3e-2)


@pytest.mark.slow
def test_train_batch_with_bf16_states_equals_its_micro_steps(tmp_path):
    """train_batch of K against K backward calls with grad_accumulation=K: the same updates, so the
    same draws of the rounding generator and the same values."""
    data = batches(6, batch=2)

    def make(accumulate: int) -> outcore.Engine:
        torch.manual_seed(0)
        cfg = outcore.Config(state_dtype="bf16", offload_params="cpu", offload_optimizer="cpu",
                             grad_accumulation=accumulate)
        return outcore.Engine(TinyGPT(), cfg, outcore.AdamW(lr=1e-3))

    vertical = make(1)
    batched = [vertical.train_batch(data[i : i + 2])["losses"] for i in (0, 2, 4)]
    vertical.close()
    stepped = make(2)
    windows, _ = train_engine(None, None, data, accum=2, engine=stepped)  # each window's mean loss
    stepped.close()
    assert [sum(pair) / 2 for pair in batched] == pytest.approx(windows, rel=1e-5)
