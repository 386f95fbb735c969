"""Forward passes repeated without grad (generation, evaluation): the units that fit stay gathered for
the whole cycle, the rest stream, so a token reads the model's bytes outside the budgets; tokens equal
plain `generate`'s; training after it is as before ([Note: forward cycles])."""

import pytest
import torch
import transformers
from hf_models import VOCAB, deferred

import outcore
from outcore.offload import Tier
from outcore.runtime.forward_cycle import plan_cycle

NEW = 6  # tokens generated: one pass each (the first over the prompt)


def test_the_plan_keeps_the_largest_units_on_device_then_on_host_and_streams_the_rest():
    sizes = {5: 30, 0: 10, 1: 10, 2: 10, 3: 10, 4: 30}
    everything = plan_cycle([5, 0, 1, 2, 3, 4], sizes, device_room=100, host_room=0, window=30)
    assert everything.kept == dict.fromkeys([5, 0, 1, 2, 3, 4], Tier.DEVICE) and everything.streamed == ()
    plan = plan_cycle([5, 0, 1, 2, 3, 4], sizes, device_room=70, host_room=25, window=10)
    # The two units of 10 streamed are spread over the four (each read while kept ones run).
    assert plan.kept == {5: Tier.DEVICE, 4: Tier.DEVICE, 0: Tier.HOST, 2: Tier.HOST}
    assert plan.streamed == (1, 3)
    assert plan.streamed_after(5, 1) == [1]
    assert plan.streamed_after(3, 2) == [1, 3]  # the next pass's first, read ahead
    assert plan.streamed_after(4, 5) == [1, 3]
    blocks = plan_cycle(list(range(16)), dict.fromkeys(range(16), 10), device_room=80, host_room=60, window=20)
    assert blocks.streamed == (3, 7, 11, 15)


def llama(directory: str) -> str:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def stored_bytes(engine) -> int:
    return sum(u.stored_nbytes for u in engine.units)


def generate(model, prompt):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)


@pytest.mark.parametrize("share", [2.0, 0.5, 0.3])
def test_a_token_reads_the_model_bytes_outside_the_budgets_and_equals_plain_generate(tmp_path, share):
    directory = llama(str(tmp_path / "m"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    probe = outcore.Engine(deferred(directory), outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme",
                                                               nvme_dir=str(tmp_path / "p")), weights=directory)
    total = stored_bytes(probe)
    probe.close()
    budget = int(share * total)
    model = deferred(directory).requires_grad_(False)  # inference: no optimizer states beside the weights
    engine = outcore.Engine(model, outcore.Config(
        stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"), grad_clip=None,
        device_budget=budget, host_budget=budget, prefetch_depth=2), weights=directory)
    engine.module.eval()
    prompt = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(generate(engine.module, prompt), generate(ref, prompt))  # the first call plans the cycle
    cycle = engine.lifecycle.cycle
    assert cycle.plan is not None
    read0 = engine.stats()["bytes_read"]
    ours = generate(engine.module, prompt)
    read = engine.stats()["bytes_read"] - read0
    assert torch.equal(ours, generate(ref, prompt))
    streamed = cycle.streamed_bytes()
    biggest = max(u.stored_nbytes for u in engine.units)
    window = (engine.policy.device_window + 1) * biggest  # the unit running, those read ahead
    outside = max(0, total - 2 * budget)  # the model's bytes beyond both budgets
    # A pass reads at most the streamed units, once each (what the room left beside the window
    # holds by chance is a hit), and never a kept one; they are the model's bytes outside the
    # budgets, the window and what does not fill a whole unit in each tier aside.
    assert outside <= read / NEW <= streamed
    assert streamed <= outside + window + 2 * biggest
    if share >= 1:
        assert read == streamed == 0 and len(cycle.plan.kept) == len(engine.units)
    else:
        assert 0 < streamed < total
    engine.close()


def lora_engine(directory: str, nvme: str, budget: int | None = None):
    import peft

    with outcore.deferred_init():
        base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                          lora_dropout=0.0, init_lora_weights=False))
    config = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=nvme, grad_clip=None,
                            device_budget=budget, host_budget=budget)
    return outcore.Engine(model, config, outcore.AdamW(lr=1e-2), weights=directory)


def test_training_between_and_around_cycles_equals_training_without_them(tmp_path):
    """Generation, then steps whose forward is followed by a reference pass without grad (DPO's),
    then generation again: the losses and the trained adapters equal an engine that never generates."""
    directory = llama(str(tmp_path / "m"))
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(1, VOCAB, (2, 8), generator=g) for _ in range(3)]
    prompt = batches[0][:, :4]
    runs = {}
    for kind in ("cycles", "none"):
        engine = lora_engine(directory, str(tmp_path / kind), budget=512 << 10)
        losses = []
        for x in batches:
            if kind == "cycles":
                generate(engine.module, prompt)
                assert engine.lifecycle.cycle.plan is not None and engine.lifecycle.cycle.held
            loss = engine.module(input_ids=x, labels=x).loss
            if kind == "cycles":  # a reference pass between the forward and its backward: no cycle starts
                with torch.no_grad():
                    engine.module(input_ids=x)
                    engine.module(input_ids=x)
                assert engine.lifecycle.cycle.plan is None
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        adapters = {k: v.clone() for k, v in engine.full_state_dict().items() if "lora" in k}
        runs[kind] = (losses, generate(engine.module, prompt), adapters)
        engine.close()
    assert runs["cycles"][0] == runs["none"][0]
    assert torch.equal(runs["cycles"][1], runs["none"][1])
    for name, value in runs["none"][2].items():
        assert torch.equal(runs["cycles"][2][name], value), name


def test_a_quantized_base_streamed_through_small_budgets_generates_as_bitsandbytes_does(tmp_path):
    """nf4: a kept unit stays decoded for the cycle, a streamed one reads its codes and decodes them
    each pass; the tokens are bitsandbytes' own."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from test_quantized import LORA, _reference

    directory = llama(str(tmp_path / "m"))
    with outcore.deferred_init():
        model = peft.get_peft_model(deferred(directory), peft.LoraConfig(**LORA))
    budget = 448 << 10
    engine = outcore.Engine(model, outcore.Config(
        stage=3, offload_params="nvme", offload_optimizer="nvme", grad_clip=None, nvme_dir=str(tmp_path / "nvme"),
        quantize="nf4", device_budget=budget, host_budget=budget), outcore.AdamW(lr=1e-3), weights=directory)
    assert 2 * budget < sum(u.gathered_nbytes for u in engine.units)  # not all of it decoded at once
    ref = _reference(directory)
    ref.load_state_dict({k: v for k, v in engine.full_state_dict().items() if "lora_" in k}, strict=False)
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = ref.generate(input_ids=prompt, max_new_tokens=NEW, do_sample=False)  # (train mode: no packed kernel)
        assert torch.equal(engine.module.generate(input_ids=prompt, max_new_tokens=NEW, do_sample=False), theirs)
        cycle = engine.lifecycle.cycle
        assert any(engine.units[i].decodes_in_store for i in cycle.plan.kept)
        streamed = [engine.units[i] for i in cycle.plan.streamed]
        assert any(u.decodes_in_store for u in streamed)
        read0 = engine.stats()["bytes_read"]
        assert torch.equal(engine.module.generate(input_ids=prompt, max_new_tokens=NEW, do_sample=False), theirs)
    assert engine.stats()["bytes_read"] - read0 <= NEW * sum(u.stored_nbytes for u in streamed)
    engine.close()


@pytest.mark.cuda
def test_on_a_gpu_a_cycle_keeps_units_in_device_memory_and_streams_the_rest(tmp_path):
    directory = llama(str(tmp_path / "m"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory).eval().cuda()
    model = deferred(directory).requires_grad_(False)
    total = 4 * sum(p.numel() for p in model.parameters())
    engine = outcore.Engine(model, outcore.Config(
        stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"), grad_clip=None,
        device_budget=total // 2, host_budget=total // 2), weights=directory, device="cuda")
    engine.module.eval()
    prompt = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1)).cuda()
    assert torch.equal(generate(engine.module, prompt), generate(ref, prompt))
    cycle = engine.lifecycle.cycle
    assert set(cycle.plan.kept.values()) == {Tier.DEVICE} and cycle.plan.streamed  # no unit kept in HOST
    read0 = engine.stats()["bytes_read"]
    assert torch.equal(generate(engine.module, prompt), generate(ref, prompt))
    assert engine.stats()["bytes_read"] - read0 <= NEW * cycle.streamed_bytes()
    engine.close()
