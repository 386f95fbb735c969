"""`Engine.train_batch`: K micro-batches as one optimizer step, each unit gathered once in forward
and once in backward for all K, equal to K backward() calls with grad_accumulation=K."""

import pytest
import torch
from helpers import assert_losses_match, assert_same_weights
from hf_models import deferred, save_model, token_batches
from models import TinyGPT, batches

import outcore
from outcore.runtime import saved_activations

K = 4


def gpt_engine(tmp_path, name, accum, *, stage=3, params="nvme", optim="nvme", clip=None, **kw):
    torch.manual_seed(0)
    cfg = outcore.Config(stage=stage, offload_params=params if stage == 3 else "none", offload_optimizer=optim,
                         nvme_dir=str(tmp_path / name), grad_accumulation=accum, grad_clip=clip,
                         sub_group_size=4096, **kw)
    return outcore.Engine(TinyGPT(d=64, vocab=128, tied=False), cfg, outcore.AdamW(lr=1e-2))


def accumulate(engine, data):
    """The reference: K forward/backward calls and a step per window."""
    losses = []
    for x, y in data:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("stage, params, optim, clip", [(3, "nvme", "nvme", None), (3, "nvme", "nvme", 1.0),
                                                        (2, "none", "nvme", None), (3, "cpu", "cpu", 1.0)])
def test_train_batch_equals_accumulation_on_a_gpt(tmp_path, stage, params, optim, clip):
    data = batches(3 * K, batch=2, vocab=128)
    ref = gpt_engine(tmp_path, "ref", K, stage=stage, params=params, optim=optim, clip=clip)
    ref_losses = accumulate(ref, data)
    ours = gpt_engine(tmp_path, "ours", 1, stage=stage, params=params, optim=optim, clip=clip)
    losses = []
    for s in range(3):
        stats = ours.train_batch(data[s * K:(s + 1) * K])
        assert not stats["accumulating"] and len(stats["losses"]) == K
        losses += stats["losses"]
    assert_losses_match(losses, ref_losses, rel=1e-5)
    assert_same_weights(ref, ours)
    assert ours.global_step == ref.global_step == 3
    assert not [k for k in ours.store.keys() if k.startswith("act.")]
    ref.close()
    ours.close()


@pytest.mark.parametrize("dtype, lora", [("fp32", False), ("bf16", False), ("fp32", True)])
def test_train_batch_equals_accumulation_on_a_hugging_face_llama(tmp_path, dtype, lora):
    """With LoRA every layer is two units (its adapters and its frozen base), one module: wrapped
    twice for recomputation, it was refused as a module whose forward is an instance attribute."""
    directory = save_model("llama", str(tmp_path / "llama"))
    data = token_batches(2 * K, batch=2, seq=12)
    clip = None if dtype == "fp32" else 1e9  # bf16: a norm to compare (fp32 sums of the same parts)

    def engine(name, accum):
        cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / name),
                             grad_accumulation=accum, grad_clip=clip, dtype=dtype)
        model = deferred(directory)
        if lora:
            peft = pytest.importorskip("peft")
            model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                               lora_dropout=0.0, init_lora_weights=False))
        return outcore.Engine(model, cfg, outcore.AdamW(lr=1e-3), weights=directory)

    ref = engine("ref", K)
    ref_losses, ref_norms = [], []
    for ids in data:
        out = ref(input_ids=ids, labels=ids)
        ref.backward(out.loss)
        stats = ref.step()
        ref_losses.append(float(out.loss.detach()))
        if not stats["accumulating"]:
            ref_norms.append(stats["grad_norm"])
    ours = engine("ours", 1)
    losses, norms = [], []
    for s in range(2):
        stats = ours.train_batch([{"input_ids": ids, "labels": ids} for ids in data[s * K:(s + 1) * K]])
        losses += stats["losses"]
        norms.append(stats["grad_norm"])
    assert_losses_match(losses, ref_losses, rel=1e-5)
    if clip is not None:
        assert norms == pytest.approx(ref_norms, rel=2e-5)
    assert_same_weights(ref, ours)
    ref.close()
    ours.close()


def read_per_step(engine, run) -> int:
    engine.synchronize()
    before = engine.stats()["bytes_read"]
    run()
    engine.synchronize()
    return engine.stats()["bytes_read"] - before


def test_parameters_are_read_once_per_optimizer_step(tmp_path, monkeypatch):
    """Budgets too small for the parameters: every gather reads NVMe. K=4 through train_batch reads
    what one micro-batch's step reads, plus the activation keys that came back from NVMe; K=4
    micro-steps read the parameters K times over."""
    monkeypatch.setattr(saved_activations, "PAGED_BYTES", 1 << 12)  # page the small test's activations too
    budgets = {"host_budget": 600_000, "device_budget": 500_000}
    data = batches(2 * K, batch=2, vocab=128)
    # the references keep their activations in place: what they read is the parameters
    one = gpt_engine(tmp_path, "one", 1, offload_activations="none", **budgets)
    micro = gpt_engine(tmp_path, "micro", K, offload_activations="none", **budgets)
    ours = gpt_engine(tmp_path, "ours", 1, **budgets)
    # the first step records the unit order (prefetch) and grows the swap file
    accumulate(one, data[:1])
    accumulate(micro, data[:K])
    ours.train_batch(data[:K])
    read_one = read_per_step(one, lambda: accumulate(one, data[K:K + 1]))
    read_micro = read_per_step(micro, lambda: accumulate(micro, data[K:]))
    read_ours = read_per_step(ours, lambda: ours.train_batch(data[K:]))
    acts = ours.stats()["activations"]
    assert acts["bytes_paged"] > 0
    assert read_ours == read_one + acts["bytes_from_nvme"]
    param_bytes = sum(u.layout.padded * 4 for u in ours.units)
    assert read_one >= 2 * param_bytes  # a step gathers every unit in forward and again in backward
    assert read_micro > 3 * read_one  # K of those (less what stays cached between micro-batches)
    for e in (one, micro, ours):
        e.close()


@pytest.mark.parametrize("host_budget", [None, 1 << 20])
def test_nothing_offloaded_pages_activations_only_with_a_host_budget(tmp_path, monkeypatch, caplog, host_budget):
    """A resident engine given no HOST budget keeps train_batch's activations as plain accumulation
    does, without a word; given one, it pages them within it."""
    monkeypatch.setattr(saved_activations, "PAGED_BYTES", 1 << 12)
    monkeypatch.setattr(saved_activations.SavedActivations, "_said_kept", False)
    torch.manual_seed(0)
    engine = outcore.Engine(TinyGPT(vocab=128), outcore.Config(stage=3, host_budget=host_budget))
    with caplog.at_level("WARNING"):
        engine.train_batch(batches(K, batch=2, vocab=128))
    acts = engine.stats()["activations"]
    assert (acts["bytes_paged"] > 0) == (host_budget is not None) and acts["bytes_kept"] + acts["bytes_paged"] > 0
    assert not [r for r in caplog.records if "train_batch" in r.message]
    engine.close()


def test_a_unit_that_cannot_be_wrapped_is_named_and_nothing_changes(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model[0].forward = model[0].forward  # an instance attribute, as some wrappers leave
    engine = outcore.Engine(model, outcore.Config(stage=3, unit_classes=("Linear",)))
    with pytest.raises(ValueError, match="Linear: its forward is an instance attribute"):
        engine.train_batch([(torch.randn(2, 8),)], loss_fn=lambda out, _: out.mean())
    assert "forward" in model[0].__dict__ and "forward" not in model[1].__dict__
    engine.close()


def test_losses_come_from_loss_fn_or_the_output(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    engine = outcore.Engine(model, outcore.Config(stage=3, unit_classes=("Linear",)))
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="not a scalar loss"):
        engine.train_batch([x])
    stats = engine.train_batch([x, x], loss_fn=lambda out, mb: (out - mb.sum()).square().mean())
    assert len(stats["losses"]) == 2 and stats["losses"][0] == stats["losses"][1]
    with pytest.raises(ValueError, match="at least one"):
        engine.train_batch([])
    with pytest.raises(TypeError, match=r"got a generator\. From an iterator take K"):
        engine.train_batch(mb for mb in [x, x])  # DeepSpeed's train_batch takes an iterator: not this one
    assert len(engine.train_batch((x, x), loss_fn=lambda out, _: out.mean())["losses"]) == 2  # a tuple is one
    engine.close()


def test_each_unit_is_gathered_once_in_forward_and_once_in_backward(tmp_path, monkeypatch):
    """The schedule itself: K=4 micro-batches gather every block twice in all (not 2K times), and
    at most one block at a time beside the root unit, in backward as in forward."""
    from outcore.runtime import flat_unit

    gathers: list[int] = []
    live: set[int] = set()
    peak = [0]
    unshard, reshard = flat_unit.FlatUnit.unshard, flat_unit.FlatUnit.reshard

    def counting_unshard(self, *tier):
        unshard(self, *tier)
        gathers.append(self.index)
        live.add(self.index)
        peak[0] = max(peak[0], len(live))

    def counting_reshard(self):
        reshard(self)
        live.discard(self.index)

    monkeypatch.setattr(flat_unit.FlatUnit, "unshard", counting_unshard)
    monkeypatch.setattr(flat_unit.FlatUnit, "reshard", counting_reshard)
    torch.manual_seed(0)
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "n"),
                         grad_clip=None)
    engine = outcore.Engine(TinyGPT(d=64, vocab=128, layers=6, tied=False), cfg)
    engine.train_batch(batches(K, batch=2, vocab=128))
    root = next(u.index for u in engine.units if u.plan.module is engine.model)
    blocks = [u.index for u in engine.units if u.index != root]
    assert {i: gathers.count(i) for i in blocks} == {i: 2 for i in blocks}
    assert gathers.count(root) == 1  # gathered for the whole step
    assert peak[0] == 2
    engine.close()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_gradients_are_summed_in_fp32_as_accumulation_does(tmp_path, dtype):
    """In bf16 and fp16 each micro-batch's gradient is added into the fp32 shard on its own, as K
    backward passes are: the gradient norm equals theirs to fp32 rounding, not to the compute
    dtype's (a sum inside autograd, in bf16, differs by about 1e-3)."""
    data = batches(3 * K, batch=2, vocab=128)
    ref = gpt_engine(tmp_path, "ref", K, clip=1e9, dtype=dtype)
    ours = gpt_engine(tmp_path, "ours", 1, clip=1e9, dtype=dtype)
    updated = 0
    for s in range(3):
        window = data[s * K:(s + 1) * K]
        for x, y in window:
            ref.backward(ref(x, y))
            ref_stats = ref.step()
        stats = ours.train_batch(window)
        assert stats["skipped"] == ref_stats["skipped"]  # fp16: the same overflows, loss scale and skips
        assert stats["loss_scale"] == ref_stats["loss_scale"]
        if not stats["skipped"]:
            updated += 1
            assert stats["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=2e-5)
    assert updated >= 1
    assert_same_weights(ref, ours, tol=1e-5)
    ref.close()
    ours.close()


def opt_engine(tmp_path, name, directory, accum=1):
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / name),
                         grad_accumulation=accum, grad_clip=None, dtype="fp32")
    return outcore.Engine(deferred(directory), cfg, outcore.AdamW(lr=1e-3), weights=directory)


def test_dropout_in_one_micro_batch_equals_a_plain_step_as_recomputation_replays_the_masks(tmp_path):
    """OPT applies dropout (0.1 here) in every layer; train_batch recomputes each layer in backward,
    which must draw the forward's masks again for the gradients to be right."""
    from transformers import AutoModelForCausalLM

    directory = save_model("opt", str(tmp_path / "opt"), dropout=0.1)
    data = token_batches(3, batch=2, seq=12)
    plain = AutoModelForCausalLM.from_pretrained(directory).train()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    ours = opt_engine(tmp_path, "ours", directory)
    for i, ids in enumerate(data):
        torch.manual_seed(10 + i)
        loss = plain(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.manual_seed(10 + i)
        assert ours.train_batch([{"input_ids": ids, "labels": ids}])["losses"] == [pytest.approx(loss.item(), rel=1e-6)]
    weights = ours.full_state_dict()
    # assert_same_weights's tolerances: k_proj's bias has no true gradient, only rounding noise
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-5, msg=name)
    ours.close()


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_dropout_across_micro_batches_is_said_once_and_reproducible_for_a_seed(tmp_path, caplog, dropout):
    directory = save_model("opt", str(tmp_path / "opt"), dropout=dropout)
    data = [{"input_ids": ids, "labels": ids} for ids in token_batches(2 * K, batch=2, seq=12)]

    def run(name):
        engine = opt_engine(tmp_path, name, directory)
        torch.manual_seed(5)
        losses = engine.train_batch(data[:K])["losses"] + engine.train_batch(data[K:])["losses"]
        weights = engine.full_state_dict()
        engine.close()
        return losses, weights

    with caplog.at_level("WARNING", logger="outcore.runtime.vertical"):
        first, first_weights = run("first")
    said = [r for r in caplog.records if "draws random numbers in its forward" in r.getMessage()]
    assert len(said) == (1 if dropout else 0)  # once per engine, for its two batches
    second, second_weights = run("second")
    assert second == first and all(torch.equal(second_weights[k], v) for k, v in first_weights.items())
    if not dropout:  # nothing random: the numbers of K backward() calls
        ref = opt_engine(tmp_path, "ref", directory, accum=K)
        ref_losses = []
        for batch in data:
            loss = ref(**batch).loss
            ref.backward(loss)
            ref.step()
            ref_losses.append(loss.item())
        assert_losses_match(first, ref_losses, rel=1e-5)
        ref.close()
