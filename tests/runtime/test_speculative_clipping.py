"""Clipping with updates behind backward ([Note: speculative clipping] in runtime/update_stream.py):
the speculated updates that stand, those done again because the step clipped, and the steps between,
all as plain PyTorch's clip_grad_norm_ + AdamW; a step that never clips exactly as no clipping."""

import copy
import dataclasses

import pytest
import torch
from helpers import HP, assert_losses_match, train_engine, train_plain, twins
from models import TinyGPT, batches

import outcore
from outcore.offload import Tier

# TinyGPT's gradient norms over these 20 batches start 7.42 8.12 8.41 7.87 7.05 7.53 7.71 7.08 6.58 and
# then fall (helpers' HP); at 7.5 the steps clip, or not, in every order: speculated and kept,
# speculated and redone, clipped without speculating, unclipped without speculating.
PATTERNS = {"never": (100.0, 20, 0), "every": (0.5, 0, 1), "alternately": (7.5, 13, 2)}


def config(tmp_path, clip) -> outcore.Config:
    return outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                          grad_clip=clip)


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("host_budget", [None, "least"])
def test_speculated_updates_kept_or_redone_equal_clip_grad_norm(tmp_path, pattern, host_budget):
    clip, kept, redone = PATTERNS[pattern]
    ours_model, ref_model = twins(TinyGPT)
    data = batches(20)
    ref = train_plain(ref_model, data, clip=clip)
    cfg = config(tmp_path, clip)
    if host_budget == "least":  # no unit's states kept in HOST, and every speculation under eviction
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
    assert engine.stats()["speculative_updates"] == {"kept": kept * units, "redone": redone * units}
    assert not [k for k in engine.store.keys() if k.endswith("~")]  # no shadow key outlives its step
    engine.close()


def test_a_step_that_never_clips_is_bit_for_bit_the_unclipped_one(tmp_path):
    a, b = twins(TinyGPT)
    data = batches(6)
    _, clipped = train_engine(a, config(tmp_path / "a", 1e6), data)
    _, unclipped = train_engine(b, config(tmp_path / "b", None), data)
    for (k, x), y in zip(clipped.full_state_dict().items(), unclipped.full_state_dict().values(), strict=True):
        assert torch.equal(x, y), k
    clipped.close()
    unclipped.close()


class Raise(torch.autograd.Function):
    """The identity in forward; a ValueError in backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("injected")


def test_a_failed_backward_drops_the_updates_it_speculated_and_the_run_goes_on_as_plain(tmp_path):
    ours_model, ref_model = twins(TinyGPT)
    data = batches(6)
    engine = outcore.Engine(ours_model, config(tmp_path, 100.0), outcore.AdamW(**HP))
    train_engine(ours_model, None, data[:2], engine=engine)
    before = engine.full_state_dict()
    # after block 0 in forward: in backward, the head's and block 1's updates have started when it raises
    hook = ours_model.blocks[0].register_forward_hook(lambda _m, _a, out: Raise.apply(out))
    x, y = data[2]
    with pytest.raises(ValueError, match="injected"):
        engine.backward(engine(x, y))
    hook.remove()
    assert not [k for k in engine.store.keys() if k.endswith("~")]
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    ours, _ = train_engine(ours_model, None, data[2:], engine=engine)
    ref = train_plain(ref_model, data, clip=100.0)
    assert_losses_match(ours, ref[2:])
    assert engine.stats()["speculative_updates"]["redone"] == 0
    engine.close()


def test_states_resting_in_host_wait_for_the_norm(tmp_path):
    """Offloaded to CPU memory, a speculation's new states would double them there: no speculation."""
    ours_model, ref_model = twins(TinyGPT)
    data = batches(4)
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="cpu", nvme_dir=str(tmp_path),
                         grad_clip=100.0)
    ours, engine = train_engine(ours_model, cfg, data)
    assert_losses_match(ours, train_plain(ref_model, data, clip=100.0))
    assert engine.stats()["speculative_updates"] == {"kept": 0, "redone": 0}
    engine.close()
