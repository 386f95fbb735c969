"""Clipping with updates behind backward ([Note: speculative clipping] in runtime/update_stream.py):
the speculated updates that stand, those done again because the step clipped, and the steps between,
all as plain PyTorch's clip_grad_norm_ + AdamW; a step that never clips exactly as no clipping; a
failed pass or a norm that is not finite taken back exactly, or the engine stopped where it cannot be."""

import copy
import dataclasses

import pytest
import torch
from helpers import HP, InBackward, assert_losses_match, train_engine, train_plain, twins
from models import TinyGPT, batches

import outcore
from outcore.offload import Tier, TieredStore

# TinyGPT's gradient norms over these 20 batches start 7.42 8.12 8.41 7.87 7.05 7.53 7.71 7.08 6.58 and
# then fall (helpers' HP); at 7.5 the steps clip, or not, in every order: speculated and kept,
# speculated and redone, clipped without speculating, unclipped without speculating.
PATTERNS = {"never": (100.0, 20, 0), "every": (0.5, 0, 1), "alternately": (7.5, 13, 2)}


def config(tmp_path, clip, **more) -> outcore.Config:
    return outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                          grad_clip=clip, **more)


# Room for a copy of every dirty parameter shard beside the working set (the derived budgets are the
# working set itself), so that each speculation can be taken back exactly: in DEVICE, which on a CPU
# is RAM too (room in HOST would keep the optimizer states there, and those wait for the norm).
ROOMY = {"device_budget": 16 << 20}


def no_key_kept(engine) -> bool:
    return not [k for k in engine.store.keys() if engine.store.is_kept(k)]


@pytest.mark.slow
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("host_budget", [None, "least"])
def test_speculated_updates_kept_or_redone_equal_clip_grad_norm(tmp_path, pattern, host_budget):
    clip, kept, redone = PATTERNS[pattern]
    ours_model, ref_model = twins(TinyGPT)
    data = batches(20)
    ref = train_plain(ref_model, data, clip=clip)
    cfg = config(tmp_path, clip)
    if host_budget == "least":  # every speculation under eviction
        probe = outcore.Engine(copy.deepcopy(ours_model), cfg)
        cfg = dataclasses.replace(cfg, host_budget=probe.memory_plan().host_min)
        probe.close()
    ours, engine = train_engine(ours_model, cfg, data)
    assert_losses_match(ours, ref)
    state, want = engine.full_state_dict(), ref_model.state_dict()
    for k in want:
        torch.testing.assert_close(state[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    # units whose states rest on NVMe speculate; those the host budget keeps wait for the norm
    units = sum(1 for u in engine.units if u.chunks and engine.place.opt_home(u.index) == Tier.NVME)
    assert units >= 2
    assert engine.stats()["speculative_updates"] == {"kept": kept * units, "redone": redone * units, "taken_back": 0,
                                                     "waited": 0}
    assert no_key_kept(engine)  # nothing kept outlives its step
    engine.close()


def keep_no_shards(monkeypatch) -> None:
    """The store keeps no parameter shard (as for a dirty one with no room for its copy): a failed
    pass then cannot be taken back exactly."""
    keep = TieredStore.keep

    def moments_only(store, keys):
        keys = list(keys)
        return False if all(k.endswith(".param") for k in keys) else keep(store, keys)

    monkeypatch.setattr(TieredStore, "keep", moments_only)


@pytest.fixture
def shards_never_kept(monkeypatch):
    keep_no_shards(monkeypatch)


@pytest.mark.parametrize("pattern", ["every", "alternately"])
def test_a_redo_is_bit_for_bit_the_same_whether_the_shards_were_kept_or_not(tmp_path, pattern, monkeypatch):
    """A redo takes the parameters back from the moments either way, so that which shards the
    budgets let the store keep (a matter of timing) never changes a bit."""
    clip = PATTERNS[pattern][0]
    a, b = twins(TinyGPT)
    data = batches(20)
    _, kept = train_engine(a, config(tmp_path / "a", clip, **ROOMY), data)
    keep_no_shards(monkeypatch)
    _, not_kept = train_engine(b, config(tmp_path / "b", clip, **ROOMY), data)
    assert kept.stats()["speculative_updates"]["redone"] == not_kept.stats()["speculative_updates"]["redone"] > 0
    for (k, x), y in zip(kept.full_state_dict().items(), not_kept.full_state_dict().values(), strict=True):
        assert torch.equal(x, y), k
    kept.close()
    not_kept.close()


def test_a_step_that_never_clips_is_bit_for_bit_the_unclipped_one(tmp_path):
    a, b = twins(TinyGPT)
    data = batches(6)
    _, clipped = train_engine(a, config(tmp_path / "a", 1e6), data)
    _, unclipped = train_engine(b, config(tmp_path / "b", None), data)
    for (k, x), y in zip(clipped.full_state_dict().items(), unclipped.full_state_dict().values(), strict=True):
        assert torch.equal(x, y), k
    clipped.close()
    unclipped.close()


def injected(_grad):
    raise ValueError("injected")


def on_output_of(block, effect):
    """A hook on `block`'s output: its input gets `effect`'s gradient in backward."""
    return block.register_forward_hook(lambda _m, _a, out: InBackward.apply(out, effect))


def after_two_steps(tmp_path, n, **more):
    """Twin models, `n` batches, and an engine (clipping at 100, never reached) trained on the first two."""
    ours_model, ref_model = twins(TinyGPT)
    data = batches(n)
    engine = outcore.Engine(ours_model, config(tmp_path, 100.0, **more), outcore.AdamW(**HP))
    train_engine(ours_model, None, data[:2], engine=engine)
    return ours_model, ref_model, data, engine


def test_a_failed_backward_takes_back_the_updates_it_speculated_and_the_run_goes_on_as_plain(tmp_path):
    ours_model, ref_model, data, engine = after_two_steps(tmp_path, 6, **ROOMY)
    before = engine.full_state_dict()
    # after block 0 in forward: in backward, the head's and block 1's updates have started when it raises
    hook = on_output_of(ours_model.blocks[0], injected)
    x, y = data[2]
    with pytest.raises(ValueError, match="injected"):
        engine.backward(engine(x, y))
    hook.remove()
    assert engine.stats()["speculative_updates"]["taken_back"] >= 2
    assert no_key_kept(engine)
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    ours, _ = train_engine(ours_model, None, data[2:], engine=engine)
    ref = train_plain(ref_model, data, clip=100.0)
    assert_losses_match(ours, ref[2:])
    assert engine.stats()["speculative_updates"]["redone"] == 0
    engine.close()


def test_a_failed_backward_whose_speculation_cannot_be_taken_back_exactly_stops_the_engine(tmp_path,
                                                                                         shards_never_kept):
    ours_model, ref_model, data, engine = after_two_steps(tmp_path, 5)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    hook = on_output_of(ours_model.blocks[0], injected)
    x, y = data[2]
    with pytest.raises(ValueError, match="injected"):
        engine.backward(engine(x, y))
    hook.remove()
    with pytest.raises(RuntimeError, match="load_checkpoint"):
        engine(x, y)
    engine.load_checkpoint(str(tmp_path / "ckpt"))
    ours, _ = train_engine(ours_model, None, data[2:], engine=engine)
    assert_losses_match(ours, train_plain(ref_model, data, clip=100.0)[2:])
    engine.close()


def test_a_norm_that_is_not_finite_skips_the_step_and_takes_its_speculations_back(tmp_path):
    ours_model, ref_model, data, engine = after_two_steps(tmp_path, 6, **ROOMY)
    before = engine.full_state_dict()
    # block 0's input gets an infinite gradient: the units after it in backward have speculated by then
    hook = on_output_of(ours_model.blocks[0], lambda grad: grad * float("inf"))
    x, y = data[2]
    engine.backward(engine(x, y))
    stats = engine.step()
    hook.remove()
    assert stats["skipped"] and stats["grad_norm"] == float("inf")
    assert engine.stats()["speculative_updates"]["taken_back"] >= 2
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    ours, _ = train_engine(ours_model, None, data[3:], engine=engine)
    ref = train_plain(ref_model, data[:2] + data[3:], clip=100.0)
    assert_losses_match(ours, ref[2:])
    engine.close()


def test_a_norm_that_is_not_finite_after_speculations_that_cannot_be_taken_back_stops_the_engine(
        tmp_path, shards_never_kept):
    ours_model, _, data, engine = after_two_steps(tmp_path, 3)
    hook = on_output_of(ours_model.blocks[0], lambda grad: grad * float("inf"))
    x, y = data[2]
    engine.backward(engine(x, y))
    hook.remove()
    with pytest.raises(RuntimeError, match="not finite.*load_checkpoint"):
        engine.step()
    with pytest.raises(RuntimeError, match="load_checkpoint"):
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.close()


def test_states_resting_in_host_wait_for_the_norm(tmp_path):
    """Offloaded to CPU memory, the states are not where a speculation could keep them for nothing."""
    ours_model, ref_model = twins(TinyGPT)
    data = batches(4)
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="cpu", nvme_dir=str(tmp_path),
                         grad_clip=100.0)
    ours, engine = train_engine(ours_model, cfg, data)
    assert_losses_match(ours, train_plain(ref_model, data, clip=100.0))
    assert engine.stats()["speculative_updates"] == {"kept": 0, "redone": 0, "taken_back": 0, "waited": 0}
    engine.close()
