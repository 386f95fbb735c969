"""Frozen parameters (`requires_grad=False`) in every stage and offload setting: training equals
plain PyTorch on the same model, frozen values never change, and they are never written back."""

import pytest
import torch
from helpers import HP, assert_losses_match, train_engine, train_plain, twins
from models import TinyGPT, batches

import outcore
from outcore.offload import Tier


def freeze(model: TinyGPT) -> TinyGPT:
    """A frozen (tied) embedding in the root, a wholly frozen first block, a half-frozen last one."""
    model.tok.weight.requires_grad_(False)
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    model.blocks[2].mlp[0].weight.requires_grad_(False)
    return model


SETTINGS = [(3, "nvme", "nvme", 1.0), (3, "cpu", "cpu", None), (3, "none", "none", 1.0), (2, "none", "nvme", None),
            (1, "none", "cpu", 1.0)]


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "params", "optim", "clip"), SETTINGS)
def test_frozen_parameters_train_as_plain_pytorch_and_never_change(tmp_path, stage, params, optim, clip):
    ours_model, ref_model = twins(lambda: freeze(TinyGPT()))
    frozen = {n: p.detach().clone() for n, p in ref_model.named_parameters() if not p.requires_grad}
    data = batches(6)
    cfg = outcore.Config(stage=stage, offload_params=params, offload_optimizer=optim, nvme_dir=str(tmp_path),
                         grad_clip=clip, sub_group_size=1024)
    ours, engine = train_engine(ours_model, cfg, data)
    assert [u.name for u in engine.units if u.frozen] == ["blocks.0 (frozen)", "blocks.2 (frozen)", "<root> (frozen)"]
    assert_losses_match(ours, train_plain(ref_model, data, clip=clip))
    sd = engine.full_state_dict()
    for name, value in frozen.items():
        assert torch.equal(sd[name], value), f"{name} is frozen but changed"
    for name, value in ref_model.state_dict().items():
        torch.testing.assert_close(sd[name], value, rtol=1e-4, atol=1e-6, msg=name)
    # No optimizer state or gradient key for a frozen unit; resting on NVMe, it is never dirty.
    keys = engine.store.keys()
    for u in engine.units:
        if u.frozen:
            assert not [k for k in keys if k.startswith(f"u{u.index}.") and k != u.param_key]
            if params == "nvme":
                before = engine.store.stats()["writebacks"]
                engine.store.evict(u.param_key, Tier.NVME).wait()
                assert engine.store.stats()["writebacks"] == before
    engine.close()


def test_a_checkpoint_with_frozen_units_resumes_exactly(tmp_path):
    data = batches(8)
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "n"),
                         grad_clip=1.0)
    whole, e = train_engine(freeze(twins(TinyGPT)[0]), cfg, data)
    e.close()
    first, e = train_engine(freeze(twins(TinyGPT)[0]), cfg, data[:4])
    e.save_checkpoint(str(tmp_path / "ckpt"), "half")
    e.close()
    torch.manual_seed(5)  # other initial values: the checkpoint must bring back the frozen ones too
    resumed = outcore.Engine(freeze(TinyGPT()), cfg, outcore.AdamW(**HP))
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    second, resumed = train_engine(None, None, data[4:], engine=resumed)
    assert first + second == whole
    resumed.close()


def test_the_memory_plan_gives_frozen_units_no_optimizer_state_or_gradient(tmp_path):
    model = freeze(TinyGPT())
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path))
    engine = outcore.Engine(model, cfg)
    plan = engine.memory_plan()
    trainable = sum(u.layout.shard for u in engine.units if not u.frozen)
    assert plan.optimizer_states == sum(-(-8 * c.numel // 4096) * 4096 for u in engine.units for c in u.chunks)
    assert plan.optimizer_states <= 8 * trainable + 4096 * len(engine.units)
    engine.close()


def test_estimate_plans_the_bytes_the_engine_plans_for_a_model_with_frozen_units(tmp_path):
    from outcore.tools.estimate import estimate
    from outcore.tools.model_source import unit_layout

    with outcore.deferred_init():
        model = freeze(TinyGPT())
    numels, layout = unit_layout(model)
    assert layout["frozen"].count(True) == 3
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                         sub_group_size=1024)
    engine = outcore.Engine(model, cfg)
    ours = estimate(numels, dtype="fp32", stage=3, offload_params="nvme", offload_optimizer="nvme",
                    sub_group_size=1024, device="cpu", **layout)
    assert engine.memory_plan() == ours
    unfrozen = estimate(numels, dtype="fp32", stage=3, offload_params="nvme", offload_optimizer="nvme",
                        sub_group_size=1024, device="cpu")
    assert ours.nvme.states < unfrozen.nvme.states  # no optimizer state for what is frozen
    engine.close()
