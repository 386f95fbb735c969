"""Pretrained Hugging Face models under the engine: weights streamed in from safetensors, the same
logits and generations as transformers, fine-tuning equal to plain PyTorch, and an exported
directory that transformers loads back."""

import json
import os
import warnings

import pytest
import torch
from hf_models import config, deferred, files, save_model, token_batches
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GenerationConfig

import outcore
from outcore.hf.model_info import hf_checkpointing

KINDS = ["llama-tied", "llama", "qwen2", "gpt2", "gpt_neox", "mixtral", "mistral", "gemma2", "phi3", "opt", "falcon",
         "bloom"]
HP = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def nvme_config(tmp_path, **kw) -> outcore.Config:
    kw.setdefault("grad_clip", None)
    return outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme",
                          nvme_dir=str(tmp_path / "nvme"), **kw)


def plain_steps(model, data, *, clip=None) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **HP)
    losses = []
    for x in data:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def engine_steps(engine, data) -> list[float]:
    losses = []
    for x in data:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def assert_close_losses(ours, ref, rel=1e-5):
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert abs(a - b) <= rel * abs(b), f"step {i}: engine {a} vs plain {b}"


@pytest.mark.parametrize("kind", KINDS)
def test_weights_give_the_logits_and_the_generation_of_from_pretrained(tmp_path, kind):
    directory = save_model(kind, str(tmp_path / kind))
    ref = AutoModelForCausalLM.from_pretrained(directory).eval()
    engine = outcore.Engine(deferred(directory), nvme_config(tmp_path), weights=directory)
    engine.module.eval()
    x = token_batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(engine.module(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
        prompt = x[:1, :5]
        ours = engine.module.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        theirs = ref.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert ours.shape == (1, 15) and torch.equal(ours, theirs)
    # The units a cycle of passes keeps gathered borrow the store's memory: inside its budgets.
    assert engine.stats()["gathered"]["bytes"] == 0
    engine.full_state_dict()  # any other engine call ends the cycle, and lets them go
    assert all(u.state.value == "sharded" for u in engine.units)
    engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_six_fine_tuning_steps_on_nvme_equal_plain_adamw_and_the_export_loads_back(tmp_path, kind):
    directory = save_model(kind, str(tmp_path / kind))
    data = token_batches(6)
    ref = AutoModelForCausalLM.from_pretrained(directory)
    expected = plain_steps(ref, data)
    engine = outcore.Engine(deferred(directory), nvme_config(tmp_path), outcore.AdamW(**HP), weights=directory)
    assert_close_losses(engine_steps(engine, data), expected)
    out = tmp_path / "exported"
    engine.export(str(out), max_shard_size=20_000)  # a few shards of a tiny model
    shards = [f for f in files(out) if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files(out) and "config.json" in files(out)
    back = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ref.eval()
    x = token_batches(1, seed=9)[0]
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ref(x).logits, rtol=1e-4, atol=1e-5)
    engine.close()


@pytest.mark.parametrize("kind, stored, model", [
    ("gpt_neox", "embed_out.weight", "lm_head.weight"),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.3.w1.weight", "model.layers.0.mlp.experts.gate_up_proj"),
])
def test_stored_names_are_converted_as_transformers_loads_them(tmp_path, caplog, kind, stored, model):
    """save_pretrained writes these in their stored form (the tests above load them through it); a
    merged tensor is built from its parts: the experts' w1 and w3, stacked and joined per layer."""
    directory = save_model(kind, str(tmp_path / kind))
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
        assert stored in f.keys() and model not in f.keys()
    ref = AutoModelForCausalLM.from_pretrained(directory)
    with caplog.at_level("INFO", logger="outcore.runtime.pretrained"):
        engine = outcore.Engine(deferred(directory), nvme_config(tmp_path), weights=directory)
    assert [r.message for r in caplog.records if "renamed or merged" in r.message]
    torch.testing.assert_close(engine.full_state_dict()[model], ref.state_dict()[model], rtol=0, atol=0)
    engine.close()


def test_lora_on_bare_parameters_is_refused_by_name_before_anything_is_written(tmp_path):
    """peft's target_parameters (a mixture of experts' fused experts, which "all-linear" wraps under
    transformers 5) swap the parameter at every forward: it failed inside torch's parametrize."""
    peft = pytest.importorskip("peft")
    directory = save_model("mixtral", str(tmp_path / "mixtral"))
    model = peft.get_peft_model(deferred(directory), peft.LoraConfig(r=2, target_modules="all-linear"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.\w+ \(and \d+ more\) is a peft LoRA adapter on a "
                                         r"bare parameter .*target_modules=\['q_proj'"):
        outcore.Engine(model, nvme_config(tmp_path), weights=directory)
    assert not (tmp_path / "nvme").exists() or not os.listdir(tmp_path / "nvme")


def test_a_sharded_directory_with_an_index_loads_and_bf16_files_convert_once(tmp_path, caplog):
    directory = save_model("llama", str(tmp_path / "m"), max_shard_size="20KB")
    assert "model.safetensors.index.json" in files(directory)
    ref = AutoModelForCausalLM.from_pretrained(directory).eval()
    engine = outcore.Engine(deferred(directory), nvme_config(tmp_path), weights=directory)
    x = token_batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(engine.module(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
    engine.close()
    bf16 = str(tmp_path / "bf16")
    ref.to(torch.bfloat16).save_pretrained(bf16)
    with caplog.at_level("INFO", logger="outcore.runtime.pretrained"):
        engine = outcore.Engine(deferred(bf16), nvme_config(tmp_path), weights=bf16)
    said = [r.message for r in caplog.records if "converting" in r.message]
    assert len(said) == 1 and "bfloat16" in said[0]
    with torch.no_grad():  # the fp32 engine holds the bf16 values exactly
        torch.testing.assert_close(engine.module(x).logits, ref.float()(x).logits, rtol=1e-5, atol=1e-5)
    engine.close()


def test_a_full_fine_tune_with_a_frozen_embedding_and_clipping_equals_plain(tmp_path):
    directory = save_model("llama", str(tmp_path / "m"))
    data = token_batches(6)
    ref = AutoModelForCausalLM.from_pretrained(directory)
    ref.model.embed_tokens.weight.requires_grad_(False)
    before = ref.model.embed_tokens.weight.detach().clone()
    expected = plain_steps(ref, data, clip=1.0)
    model = deferred(directory)
    model.model.embed_tokens.weight.requires_grad_(False)
    engine = outcore.Engine(model, nvme_config(tmp_path, grad_clip=1.0), outcore.AdamW(**HP), weights=directory)
    assert any(u.frozen for u in engine.units)
    assert_close_losses(engine_steps(engine, data), expected)
    sd = engine.full_state_dict()
    assert torch.equal(sd["model.embed_tokens.weight"], before)  # bit for bit: never updated
    engine.close()


def test_lora_trains_only_the_adapters_as_peft_does_and_they_load_back(tmp_path):
    peft = pytest.importorskip("peft")
    directory = save_model("llama", str(tmp_path / "m"))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(deferred(directory), lora)
    engine = outcore.Engine(model, nvme_config(tmp_path, grad_clip=1.0), outcore.AdamW(**HP), weights=directory)
    start = engine.full_state_dict()
    assert all(float(v.abs().max()) == 0 for k, v in start.items() if "lora_B" in k)  # peft's init: B = 0
    ref = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory), lora)
    ref.load_state_dict({k: v for k, v in start.items() if "lora_" in k}, strict=False)  # the same adapters
    data = token_batches(6)
    expected = plain_steps(ref, data, clip=1.0)
    assert_close_losses(engine_steps(engine, data), expected)
    trained = engine.full_state_dict()
    for k, v in trained.items():
        if "lora_" not in k:
            assert torch.equal(v, start[k]), f"{k} is frozen but changed"
    assert engine.stats()["nvme"]["bytes"] > 0
    out = tmp_path / "adapters"
    engine.export(str(out), adapters_only=True)
    assert files(out) == ["adapter_config.json", "adapter_model.safetensors"]
    back = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(directory), str(out)).eval()
    ref.eval()
    x = token_batches(1, seed=9)[0]
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ref(x).logits, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="adapters_only"):
        engine.export(str(tmp_path / "whole"))
    engine.close()


@pytest.mark.parametrize(("damage", "message"), [
    ("shape", "has shape"),
    ("other-model", "have no tensor 'model\\.layers\\.0\\."),
    ("extra", "not in the model"),
    ("missing-shard", "missing"),
    ("not-safetensors", "not a readable safetensors"),
    ("generation-config", "generation_config.json does not load"),
])
def test_bad_weights_are_one_clear_error_and_nothing_is_written(tmp_path, damage, message):
    directory = save_model("llama", str(tmp_path / "m"), max_shard_size="20KB")
    weights = directory
    if damage == "shape":  # the same architecture, a wider MLP
        wide = config("llama")
        wide.intermediate_size = 48
        AutoModelForCausalLM.from_config(wide).save_pretrained(str(tmp_path / "wide"))
        weights = str(tmp_path / "wide")
    elif damage == "other-model":
        weights = save_model("gpt2", str(tmp_path / "g"))
    elif damage == "extra":  # one tensor more than the model has
        state = load_file(os.path.join(save_model("llama", str(tmp_path / "one")), "model.safetensors"))
        save_file({**state, "model.extra.weight": torch.zeros(3)}, str(tmp_path / "extra.safetensors"))
        weights = str(tmp_path / "extra.safetensors")
    elif damage == "generation-config":
        with open(os.path.join(directory, "generation_config.json"), "w") as f:
            f.write("{ not json")
    elif damage == "missing-shard":
        os.unlink(os.path.join(directory, sorted(f for f in files(directory) if f.endswith(".safetensors"))[0]))
    else:
        shard = os.path.join(directory, sorted(f for f in files(directory) if f.endswith(".safetensors"))[-1])
        with open(shard, "r+b") as f:
            f.write(b"\xff" * 16)
    with pytest.raises(ValueError, match=message) as e:
        outcore.Engine(deferred(directory), nvme_config(tmp_path), weights=weights)
    assert len(str(e.value).splitlines()) == 1
    assert not (tmp_path / "nvme").exists(), "nothing may be written before the weights are known good"


def test_a_directory_of_sharded_pytorch_model_bins_fine_tunes_as_from_pretrained_loads_it(tmp_path):
    """The Hugging Face layout before safetensors: `pytorch_model-0000i-of-0000n.bin` and their
    index, tied weights stored under both names on one storage. A Trainer's `training_args.bin`
    beside them is not a weight file."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config("llama-tied"))
    directory = tmp_path / "bin"
    model.config.save_pretrained(str(directory))
    state = model.state_dict()
    names = list(state)
    shards = {f"pytorch_model-0000{i + 1}-of-00002.bin": names[i::2] for i in range(2)}
    for shard, keys in shards.items():
        torch.save({k: state[k] for k in keys}, str(directory / shard))
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    torch.save({"not": "weights"}, str(directory / "training_args.bin"))
    data = token_batches(4)
    ref = AutoModelForCausalLM.from_pretrained(str(directory))
    expected = plain_steps(ref, data)
    engine = outcore.Engine(deferred(str(directory)), nvme_config(tmp_path), outcore.AdamW(**HP),
                            weights=str(directory))
    assert_close_losses(engine_steps(engine, data), expected)
    engine.close()


def test_a_lora_model_generates_as_peft_does(tmp_path):
    """peft's generate() runs the base model's, which reads its device from its own parameters:
    there were none (the engine's anchor sat on the peft wrapper), and it raised StopIteration."""
    peft = pytest.importorskip("peft")
    directory = save_model("llama", str(tmp_path / "m"))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    engine = outcore.Engine(peft.get_peft_model(deferred(directory), lora), nvme_config(tmp_path), weights=directory)
    ref = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory), lora)
    ref.load_state_dict({k: v for k, v in engine.full_state_dict().items() if "lora_" in k}, strict=False)
    engine.eval()
    ref.eval()
    prompt = token_batches(1)[0][:1, :5]
    with torch.no_grad():
        ours = engine.module.generate(input_ids=prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        theirs = ref.generate(input_ids=prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert ours.shape == (1, 13) and torch.equal(ours, theirs)
    engine.close()


@pytest.mark.parametrize("lora", [False, True])
def test_the_stored_generation_config_is_the_models_and_the_export_keeps_it(tmp_path, lora):
    """from_pretrained reads generation_config.json (end-of-sequence ids, sampling defaults) and
    save_pretrained writes it; a model built from its config alone has only defaults."""
    peft = pytest.importorskip("peft")
    directory = save_model("llama", str(tmp_path / "m"))
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 5], max_new_tokens=6, do_sample=True, temperature=0.7,
                     top_p=0.9).save_pretrained(directory)
    ref = AutoModelForCausalLM.from_pretrained(directory).eval()
    model = deferred(directory)
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0))
    engine = outcore.Engine(model, nvme_config(tmp_path), weights=directory)
    stored = {k: v for k, v in ref.generation_config.to_dict().items() if k != "transformers_version"}
    ours = engine.module.get_base_model() if lora else engine.module
    assert {k: v for k, v in ours.generation_config.to_dict().items() if k != "transformers_version"} == stored
    engine.eval()
    prompt = token_batches(1)[0][:1, :5]
    with torch.no_grad():  # greedy, the rest (the length, the end-of-sequence ids) from the stored config
        generated = engine.module.generate(input_ids=prompt, do_sample=False)
        torch.testing.assert_close(generated, ref.generate(input_ids=prompt, do_sample=False), rtol=0, atol=0)
    if not lora:
        engine.export(str(tmp_path / "out"))
        back = GenerationConfig.from_pretrained(str(tmp_path / "out"))
        assert {k: v for k, v in back.to_dict().items() if k != "transformers_version"} == stored
    engine.close()


def test_generation_settings_the_caller_made_are_kept(tmp_path, caplog):
    directory = save_model("llama", str(tmp_path / "m"))
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 5], max_new_tokens=6).save_pretrained(directory)
    model = deferred(directory)
    model.generation_config.max_new_tokens = 3
    with caplog.at_level("INFO", logger="outcore.hf.model_info"):
        engine = outcore.Engine(model, nvme_config(tmp_path), weights=directory)
    assert engine.module.generation_config.max_new_tokens == 3 and engine.module.generation_config.eos_token_id == 2
    said = [r.message for r in caplog.records if "generation_config" in r.message]
    assert said == [f"the model's generation_config was set before the engine: kept; "
                    f"{directory}/generation_config.json is not read"]
    engine.close()


def test_the_base_model_called_on_its_own_trains_as_plain_adamw(tmp_path):
    """`model.model(...)` (LlamaModel, a child of the root holding the root's embedding and norm)
    with a loss of one's own: the child gathers the root unit itself (it raised ReleasedParameterError)."""
    directory = save_model("llama", str(tmp_path / "m"))
    ref = AutoModelForCausalLM.from_pretrained(directory)
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    engine = outcore.Engine(deferred(directory), nvme_config(tmp_path), outcore.AdamW(**HP), weights=directory)
    ours, theirs = [], []
    for x in token_batches(3):
        loss = ref.model(input_ids=x).last_hidden_state.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        theirs.append(loss.item())
        loss = engine.module.model(input_ids=x).last_hidden_state.pow(2).mean()
        engine.backward(loss)
        engine.step()
        ours.append(loss.item())
    assert_close_losses(ours, theirs)
    engine.close()


def test_a_transformers_whose_conversion_api_moved_is_said_once_and_names_match_as_they_are(tmp_path, caplog,
                                                                                             monkeypatch):
    from outcore.hf import conversion as hf_conversion

    monkeypatch.setattr(hf_conversion, "_transformers_api", lambda: (lambda model: None, object()))
    directory = save_model("gpt_neox", str(tmp_path / "m"))
    with caplog.at_level("WARNING", logger="outcore.hf.conversion"), \
            pytest.raises(ValueError, match="have no tensor 'lm_head.weight'"):
        outcore.Engine(deferred(directory), nvme_config(tmp_path), weights=directory)
    assert [r.message for r in caplog.records if "could not be applied" in r.message]


def test_a_merged_tensor_with_a_part_missing_is_one_clear_error_and_nothing_is_written(tmp_path):
    directory = save_model("mixtral", str(tmp_path / "m"))
    path = os.path.join(directory, "model.safetensors")
    state = load_file(path)
    del state["model.layers.1.block_sparse_moe.experts.2.w1.weight"]
    save_file(state, path)
    with pytest.raises(ValueError, match=r"the model's 'model\.layers\.1\.mlp\.experts\.gate_up_proj' \(7 in all, "
                                         r"in '.*model\.safetensors'\) cannot be merged") as e:
        outcore.Engine(deferred(directory), nvme_config(tmp_path), weights=directory)
    assert len(str(e.value).splitlines()) == 1
    assert not (tmp_path / "nvme").exists()


def test_lora_with_the_models_own_activation_checkpointing_equals_plain_peft(tmp_path):
    peft = pytest.importorskip("peft")
    directory = save_model("llama", str(tmp_path / "m"))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    model = deferred(directory)
    enable = hf_checkpointing(model)
    assert enable is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # transformers 5's name, not the deprecated one
        enable()
    assert model.is_gradient_checkpointing
    model = peft.get_peft_model(model, lora)
    engine = outcore.Engine(model, nvme_config(tmp_path, grad_clip=1.0), outcore.AdamW(**HP), weights=directory)
    start = engine.full_state_dict()
    ref = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory), lora)
    ref.load_state_dict({k: v for k, v in start.items() if "lora_" in k}, strict=False)
    data = token_batches(4)
    assert_close_losses(engine_steps(engine, data), plain_steps(ref, data, clip=1.0))
    engine.close()
