import math

import pytest
import torch
from helpers import HP, train_engine, train_plain, twins
from models import TinyGPT, batches

import outcore


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_tracks_fp32_and_keeps_fp32_masters(tmp_path, dtype):
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                         dtype=dtype)
    ours_model, ref_model = twins(TinyGPT)
    data = batches(15)
    ref = train_plain(ref_model, data, clip=1.0)
    ours, engine = train_engine(ours_model, cfg, data)
    assert all(math.isfinite(v) for v in ours)
    assert ours[-1] < ours[0] - 1.0, "training in low precision still learns"
    if dtype == "bf16":
        assert max(abs(a - b) / b for a, b in zip(ours, ref, strict=True)) < 0.03
    else:  # fp16 skips its first step (2^16 x this loss overflows) and halves the scale, once
        assert engine.scaler.scale == 2.0**15 and engine.global_step == len(data) - 1
    sd = engine.full_state_dict()
    assert sd["blocks.0.mlp.0.weight"].dtype == (torch.bfloat16 if dtype == "bf16" else torch.float16)
    state = engine.store.fetch(engine.units[0].chunks[0].opt_key, outcore.runtime.engine.Tier.HOST).result()
    assert state.dtype == torch.float32
    engine.store.release(engine.units[0].chunks[0].opt_key)
    engine.close()


def test_fp16_overflow_skips_the_step_and_halves_the_scale(tmp_path):
    cfg = outcore.Config(stage=3, offload_optimizer="cpu", nvme_dir=str(tmp_path), dtype="fp16")
    torch.manual_seed(0)
    engine = outcore.Engine(TinyGPT(), cfg, outcore.AdamW(**HP))
    before = engine.full_state_dict()
    engine.scaler.scale = 2.0**40  # fp16 gradients of a loss scaled this far overflow
    x, y = batches(1)[0]
    engine.backward(engine(x, y))
    stats = engine.step()
    assert stats["skipped"] and stats["loss_scale"] == 2.0**39 and engine.global_step == 0
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step changes nothing"
    engine.scaler.scale = 2.0**10
    engine.backward(engine(x, y))
    assert not engine.step()["skipped"] and engine.global_step == 1
    engine.close()


def test_deferred_init_is_reproducible_and_never_whole(tmp_path):
    def build(seed):
        with outcore.deferred_init():
            model = TinyGPT(layers=4)
        assert all(p.is_meta for p in model.parameters())
        cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme",
                             nvme_dir=str(tmp_path / f"n{seed}{torch.rand(1).item()}"))
        return outcore.Engine(model, cfg, seed=seed)

    a, b, c = build(1), build(1), build(2)
    sa, sb, sc = a.full_state_dict(), b.full_state_dict(), c.full_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["blocks.0.mlp.0.weight"], sc["blocks.0.mlp.0.weight"])
    assert sa["blocks.0.ln1.weight"].eq(1).all(), "each module's own reset_parameters ran"
    losses, _ = train_engine(None, None, batches(5), engine=a)
    assert losses[-1] < losses[0]
    for e in (a, b, c):
        e.close()


@pytest.mark.parametrize(("offload", "holds"), [
    (("nvme", "nvme"), r"the largest unit's parameters read from NVMe: [\d,]+; 3 optimizer chunks on their way .*"
                       r"raise it to at least that, or lower sub_group_size\.$"),
    (("cpu", "none"), r"\(([\d,]+) bytes; the parameters, which rest there: \1\); raise it to at least that\.$"),
])
def test_budgets_too_small_fail_before_training_saying_what_the_budget_must_hold(tmp_path, offload, holds):
    cfg = outcore.Config(stage=3, offload_params=offload[0], offload_optimizer=offload[1], nvme_dir=str(tmp_path),
                         host_budget=8192)
    with pytest.raises(ValueError, match=r"host_budget=8,192 bytes cannot hold what host memory must hold .*" + holds):
        outcore.Engine(TinyGPT(), cfg)


def test_units_are_the_repeated_blocks_or_the_named_classes(tmp_path):
    engine = outcore.Engine(TinyGPT(), outcore.Config(stage=3, nvme_dir=str(tmp_path / "a")))
    assert [u.name for u in engine.units] == ["blocks.0", "blocks.1", "blocks.2", "<root>"]
    root = engine.units[-1]
    tied = [s for s in root.plan.slots if len(s.state_dict_names) == 2]
    assert len(tied) == 1 and sorted(tied[0].state_dict_names) == ["head.weight", "tok.weight"]
    engine.close()
    by_class = outcore.Engine(TinyGPT(), outcore.Config(stage=3, nvme_dir=str(tmp_path / "b"),
                                                        unit_classes=("Sequential",)))
    assert [u.name for u in by_class.units] == ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp", "<root>"]
    by_class.close()
    with pytest.raises(ValueError, match="matches no module"):
        outcore.Engine(TinyGPT(), outcore.Config(stage=3, nvme_dir=str(tmp_path / "c"), unit_classes=("Nope",)))


class Bare(torch.nn.Module):
    """A module with a parameter and no reset_parameters: deferred init cannot guess its values."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(4))

    def forward(self, x):
        return (x * self.w).sum()


def test_deferred_init_refuses_what_it_cannot_initialize(tmp_path):
    with outcore.deferred_init():
        model = Bare()
    with pytest.raises(ValueError, match="Bare .* no reset_parameters.*init_fn"):
        outcore.Engine(model, outcore.Config(stage=3, nvme_dir=str(tmp_path / "a")))
    with outcore.deferred_init():
        model = Bare()
    engine = outcore.Engine(model, outcore.Config(stage=3, nvme_dir=str(tmp_path / "b")),
                            init_fn=lambda m: m.w.fill_(0.5) if isinstance(m, Bare) else None)
    assert torch.equal(engine.full_state_dict()["w"], torch.full((4,), 0.5))
    engine.close()


class _WithTable(torch.nn.Module):
    """A block whose buffer is computed in __init__ (as rotary tables are)."""

    def __init__(self, d: int = 8, recompute: bool = True) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.register_buffer("table", torch.arange(d, dtype=torch.float32) / d, persistent=False)
        self.recompute = recompute

    def reset_parameters(self) -> None:
        if self.recompute:
            self.table.copy_(torch.arange(self.table.numel(), dtype=torch.float32) / self.table.numel())

    def forward(self, x):
        return self.fc(x) * self.table


class _TableStack(torch.nn.Module):
    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_WithTable(recompute=recompute) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def test_buffers_built_on_the_meta_device_are_recomputed_or_refused_by_name(tmp_path):
    with outcore.deferred_init():
        model = _TableStack(recompute=True)
    assert model.blocks[0].table.is_meta
    engine = outcore.Engine(model, outcore.Config(nvme_dir=str(tmp_path)))
    assert torch.equal(model.blocks[1].table, torch.arange(8, dtype=torch.float32) / 8)
    engine.close()
    with outcore.deferred_init():
        model = _TableStack(recompute=False)
    with pytest.raises(ValueError, match="buffer 'blocks.0.table'.*does not compute it"):
        outcore.Engine(model, outcore.Config(nvme_dir=str(tmp_path / "b")))


def test_fp16_with_a_plain_loss_backward_is_a_clear_error_and_engine_backward_still_trains(tmp_path):
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                         dtype="fp16")
    torch.manual_seed(0)
    engine = outcore.Engine(TinyGPT(), cfg, outcore.AdamW(**HP))
    before = engine.full_state_dict()
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match=r"fp16 training needs engine\.backward\(loss\) in place of loss\.backward"):
        engine(x, y).backward()
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.scaler.scale = 2.0**10  # no overflow: the step below updates
    engine.backward(engine(x, y))
    assert not engine.step()["skipped"] and engine.global_step == 1
    engine.close()
