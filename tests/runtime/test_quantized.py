"""QLoRA in the tiers (runtime/quantized.py): the frozen base's Linear weights rest as bitsandbytes'
4-bit or 8-bit codes and scales, bit for bit, and a LoRA run on them trains as plain transformers +
peft + bitsandbytes QLoRA does (fp32, one rank); a resume derives the same codes again and continues
exactly; the weights files are never written."""

import os

import pytest
import torch
from hf_models import deferred, save_model, token_batches
from test_pretrained import HP, assert_close_losses, engine_steps, plain_steps

import outcore
from outcore.offload.file_source import file_checksum

peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")
functional = pytest.importorskip("bitsandbytes.functional")

LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)


def _engine(directory, tmp_path, name, kind="nf4", double=True, params="nvme"):  # kind None: as the files hold it
    config = outcore.Config(stage=3, offload_params=params, offload_optimizer="nvme", grad_clip=None,
                            nvme_dir=str(tmp_path / f"nvme-{name}"), quantize=kind, quantize_double=double)
    model = peft.get_peft_model(deferred(directory), peft.LoraConfig(**LORA))
    return outcore.Engine(model, config, outcore.AdamW(**HP), weights=directory)


def _bnb_base(directory, kind="nf4", double=True):
    """The base as a QLoRA user loads it: transformers with bitsandbytes' 4-bit (or 8-bit) Linear layers."""
    q = transformers.BitsAndBytesConfig(load_in_8bit=True) if kind == "int8" else transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_use_double_quant=double)
    return transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=q, dtype=torch.float32,
                                                             device_map="cpu").train()


def _reference(directory, kind="nf4", double=True):
    return peft.get_peft_model(_bnb_base(directory, kind, double), peft.LoraConfig(**LORA)).train()


@pytest.mark.parametrize("kind, double", [("nf4", True), ("nf4", False), ("fp4", False)])
def test_the_stored_codes_and_scales_are_bitsandbytes_own_bit_for_bit(tmp_path, kind, double):
    directory = save_model("llama", str(tmp_path / "m"))
    engine = _engine(directory, tmp_path, "a", kind, double)
    weights = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    quantized = [u for u in engine.units if u.quantized is not None]
    assert quantized
    checked = 0
    for unit in quantized:
        raw = engine.store.fetch_now(unit.param_key, outcore.Tier.HOST).clone()
        engine.store.release(unit.param_key)
        for slot, part, at in zip(unit.plan.slots, unit.quantized.parts, unit.quantized.offsets, strict=True):
            name = slot.state_dict_names[0].replace("base_model.model.", "").replace(".base_layer", "")
            if part is None:
                continue
            codes, state = functional.quantize_4bit(weights[name], blocksize=64, quant_type=kind,
                                                    compress_statistics=double, quant_storage=torch.uint8)
            mine = raw[at : at + part.nbytes]
            assert torch.equal(mine[: codes.numel()], codes.reshape(-1))
            absmax = state.absmax.reshape(-1)  # uint8 under double quantization, else fp32
            assert torch.equal(part._split(mine)["absmax"].view(absmax.dtype), absmax)
            offset = unit.quantized.scale_offsets[unit.plan.slots.index(slot)]
            assert torch.equal(part.decode(mine, torch.float32, offset), functional.dequantize_4bit(codes, state))
            checked += 1
    assert checked == 7 * len([n for n in weights if n.endswith("mlp.down_proj.weight")])  # q k v o gate up down
    engine.close()


@pytest.mark.parametrize("params", ["nvme", "none"])
def test_qlora_trains_as_transformers_peft_and_bitsandbytes_do(tmp_path, params):
    directory = save_model("llama", str(tmp_path / "m"))
    before = file_checksum(os.path.join(directory, "model.safetensors"))
    engine = _engine(directory, tmp_path, "a", params=params)
    ref = _reference(directory)
    start = engine.full_state_dict()
    ref.load_state_dict({k: v for k, v in start.items() if "lora_" in k}, strict=False)
    x = token_batches(1)[0]
    with torch.no_grad():  # in train mode (no dropout here): eval mode on an AVX512-BF16 CPU takes
        # bitsandbytes' own bf16 inference kernel instead of the dequantized weight
        torch.testing.assert_close(engine(input_ids=x).logits, ref(input_ids=x).logits, rtol=1e-5, atol=1e-5)
    data = token_batches(4)
    assert_close_losses(engine_steps(engine, data), plain_steps(ref, data), rel=1e-4)
    ours = engine.full_state_dict()
    theirs = ref.state_dict()
    for k, v in ours.items():
        if "lora_" in k:
            torch.testing.assert_close(v, theirs[k], rtol=1e-3, atol=1e-5)
    assert file_checksum(os.path.join(directory, "model.safetensors")) == before
    engine.close()


def test_int8_codes_and_row_scales_are_bitsandbytes_own_bit_for_bit(tmp_path):
    directory = save_model("llama", str(tmp_path / "m"))
    engine = _engine(directory, tmp_path, "a", "int8", False)
    weights = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    checked = 0
    for unit in [u for u in engine.units if u.quantized is not None]:
        raw = engine.store.fetch_now(unit.param_key, outcore.Tier.HOST).clone()
        engine.store.release(unit.param_key)
        for slot, part, at in zip(unit.plan.slots, unit.quantized.parts, unit.quantized.offsets, strict=True):
            if part is None:
                continue
            name = slot.state_dict_names[0].replace("base_model.model.", "").replace(".base_layer", "")
            codes, row_absmax, _ = functional.int8_vectorwise_quant(weights[name].half())  # as Int8Params does
            mine = part._split(raw[at : at + part.nbytes])
            assert torch.equal(mine["codes"].view(torch.int8), codes.reshape(-1))
            assert torch.equal(mine["row_absmax"].view(torch.float32), row_absmax)
            layer = bnb.nn.Linear8bitLt(*reversed(codes.shape), bias=False, has_fp16_weights=False)
            layer.weight = bnb.nn.Int8Params(weights[name].clone(), requires_grad=False, has_fp16_weights=False)
            layer = layer.to("cpu").train()
            x = torch.randn(3, codes.shape[1])
            expected = layer(x)  # bitsandbytes' own training matmul on the CPU
            decoded = part.decode(raw[at : at + part.nbytes], torch.float32, None)
            torch.testing.assert_close(torch.nn.functional.linear(x, decoded), expected, rtol=0, atol=0)
            checked += 1
    assert checked == 7 * len([n for n in weights if n.endswith("mlp.down_proj.weight")])
    assert all(u.quantized.parts[i].nbytes < 0.3 * u.plan.slots[i].numel * 4 for u in engine.units
               if u.quantized is not None for i in range(len(u.plan.slots)) if u.quantized.parts[i] is not None)
    engine.close()


@pytest.mark.parametrize("saved", [False, True], ids=["quantized-at-start", "pre-quantized"])
def test_int8_lora_trains_as_transformers_peft_and_bitsandbytes_8bit_do(tmp_path, saved):
    directory = save_model("llama", str(tmp_path / "m"))
    if saved:
        directory = _pre_quantized(directory, str(tmp_path / "q"), "int8")
    before = {f: file_checksum(os.path.join(directory, f)) for f in os.listdir(directory)
              if f.endswith(".safetensors")}
    engine = _engine(directory, tmp_path, "a", None if saved else "int8", False)
    assert engine.config.quantize == "int8"
    quantized = [u for u in engine.units if u.quantized is not None]
    assert quantized and all((u.in_place is not None) == saved for u in quantized)
    ref = (peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(directory, device_map="cpu"),
                               peft.LoraConfig(**LORA)).train() if saved else _reference(directory, "int8"))
    assert any(type(m).__name__ == "Linear8bitLt" for m in ref.modules())
    ref.load_state_dict({k: v for k, v in engine.full_state_dict().items() if "lora_" in k}, strict=False)
    data = token_batches(4)
    assert_close_losses(engine_steps(engine, data), plain_steps(ref, data), rel=1e-4)
    theirs = ref.state_dict()
    for k, v in engine.full_state_dict().items():
        if "lora_" in k:
            torch.testing.assert_close(v, theirs[k], rtol=1e-3, atol=1e-5)
    engine.close()
    assert {f: file_checksum(os.path.join(directory, f)) for f in before} == before


def test_a_resume_derives_the_same_codes_and_continues_exactly(tmp_path):
    directory = save_model("llama", str(tmp_path / "m"))
    data = token_batches(4)
    engine = _engine(directory, tmp_path, "a")
    engine_steps(engine, data[:2])
    engine.save_checkpoint(str(tmp_path / "ckpt"), "two")
    expected = engine_steps(engine, data[2:])
    engine.close()
    resumed = _engine(directory, tmp_path, "b")
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert engine_steps(resumed, data[2:]) == expected
    resumed.close()
    other = _engine(directory, tmp_path, "c", kind="fp4", double=False)
    with pytest.raises(ValueError, match="rests quantized as"):
        other.load_checkpoint(str(tmp_path / "ckpt"))
    other.close()


def test_quantize_with_nothing_frozen_is_refused(tmp_path):
    directory = save_model("llama", str(tmp_path / "m"))
    config = outcore.Config(quantize="nf4")
    with pytest.raises(ValueError, match="has none frozen"):
        outcore.Engine(deferred(directory), config, weights=directory)


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_on_the_global_batch(tmp_path):
    import json
    import subprocess

    from dist_quantized import qlora_engine
    from launch import torchrun
    from test_multirank import HERE

    directory = save_model("llama", str(tmp_path / "m"))
    out = str(tmp_path / "two.json")
    cmd = [*torchrun(2, tmp_path), os.path.join(HERE, "dist_quantized.py"), directory, str(tmp_path / "nvme"), out]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    two = json.load(open(out))
    one = qlora_engine(directory, str(tmp_path / "nvme-one"))
    for x in token_batches(3, batch=4):  # the whole batch, which the two ranks halved
        one.backward(one(input_ids=x, labels=x).loss)
        one.step()
    state = one.full_state_dict()
    for k, v in two["lora"].items():  # (the halves' gradients summed in another order: fp32 rounding)
        torch.testing.assert_close(state[k], torch.tensor(v), rtol=1e-4, atol=1e-5)
    one.close()


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_the_cli_s_qlora_adapters_load_onto_bitsandbytes_quantized_base_in_peft(tmp_path, kind):
    import json

    from hf_models import STORY, save_tokenizer

    from outcore.tools.cli import main

    directory = save_model("llama", str(tmp_path / "m"))
    save_tokenizer(directory)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": STORY * 3}) + "\n" for _ in range(40)))
    assert main(["train", "--model", directory, "--data", str(data), "--seq", "16", "--batch", "4", "--out",
                 str(tmp_path / "run"), "--offload-params", "nvme", "--offload-optimizer", "nvme", "--dtype", "fp32",
                 "--eval-batches", "1", "--lora", "8", "--steps", "12", "--lr", "3e-2", "--quantize", kind,
                 *(["--quantize-double"] if kind == "nf4" else []), "--merge-adapters",
                 "--json", str(tmp_path / "s.json")]) == 0
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["config"]["quantize"] == kind and s["config"].get("quantize_double", False) is (kind == "nf4")
    adapters = str(tmp_path / "run" / "adapters")
    # the merged export: the adapters merged into the original weights (the codes only approximate them)
    merged = transformers.AutoModelForCausalLM.from_pretrained(s["exported"])
    assert all(v.dtype == torch.float32 for v in merged.state_dict().values())
    by_peft = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(directory),
                                             adapters).merge_and_unload()
    for k, v in by_peft.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[k], v, rtol=1e-6, atol=1e-6)
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    x = tok(STORY * 3, return_tensors="pt").input_ids[:, :16]  # a row it trained on
    base = _bnb_base(directory, kind)
    with torch.no_grad():
        before = base(input_ids=x, labels=x).loss.item()
    tuned = peft.PeftModel.from_pretrained(base, adapters).train()
    with torch.no_grad():
        after = tuned(input_ids=x, labels=x).loss.item()
    assert after < before - 0.1, (before, after)


def test_quantize_needs_lora_on_the_command_line(tmp_path, capsys):
    from outcore.tools.cli import main

    assert main(["train", "--quantize", "nf4", "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    assert "--quantize is a setting of LoRA adapters" in capsys.readouterr().err


def test_generate_runs_through_the_quantized_base_as_bitsandbytes_does(tmp_path):
    directory = save_model("llama", str(tmp_path / "m"))
    engine = _engine(directory, tmp_path, "a")
    ref = _reference(directory)
    ref.load_state_dict({k: v for k, v in engine.full_state_dict().items() if "lora_" in k}, strict=False)
    x = token_batches(1, batch=1)[0][:, :6]
    with torch.no_grad():
        ours = engine.module.generate(input_ids=x, max_new_tokens=5, do_sample=False)
        theirs = ref.generate(input_ids=x, max_new_tokens=5, do_sample=False)  # (train mode: no packed kernel)
    assert torch.equal(ours, theirs)
    engine.close()


def test_the_memory_plan_and_estimate_count_the_quantized_bytes(tmp_path, capsys):
    import json

    from outcore.tools.cli import main

    directory = save_model("llama", str(tmp_path / "m"))
    engine = _engine(directory, tmp_path, "a")
    plan = engine.memory_plan()
    stored = sum(u.quantized.shard for u in engine.units if u.quantized is not None)
    assert engine.stats()["nvme"]["bytes"] <= plan.nvme.states and stored <= plan.nvme.states
    engine.close()
    rows = {}
    for name, q in (("bf16", []), ("nf4", ["--quantize", "nf4", "--quantize-double"]),
                    ("int8", ["--quantize", "int8"])):
        out = tmp_path / f"e-{name}.json"
        assert main(["estimate", "--model", directory, "--lora", "4", "--stage", "3", "--offload-params", "none",
                     "--offload-optimizer", "none", "--json", str(out), *q]) == 0
        rows[name] = json.loads(out.read_text())["rows"][0]["device"]["states"]
    assert rows["nf4"] < rows["int8"] < rows["bf16"]  # (the embeddings, head and page rounding weigh most here)
    assert main(["estimate", "--model", directory, "--quantize", "nf4"]) == 2
    assert "--lora R" in capsys.readouterr().err


def _pre_quantized(directory, target, kind="nf4", double=True):
    """`directory` loaded 4-bit (or 8-bit) by transformers and bitsandbytes and saved again: pre-quantized."""
    _bnb_base(directory, kind, double).save_pretrained(target)
    return target


def test_a_pre_quantized_directory_is_read_as_stored_in_place_and_trains_as_bitsandbytes_does(tmp_path):
    directory = _pre_quantized(save_model("llama", str(tmp_path / "m")), str(tmp_path / "q"))
    files = {f: file_checksum(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(".safetensors")}
    config = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", grad_clip=None,
                            nvme_dir=str(tmp_path / "nvme"))  # no quantize: the files' own is taken
    engine = outcore.Engine(peft.get_peft_model(deferred(directory), peft.LoraConfig(**LORA)), config,
                            outcore.AdamW(**HP), weights=directory)
    assert engine.config.quantize == "nf4" and engine.config.quantize_double
    quantized = [u for u in engine.units if u.quantized is not None]
    assert quantized and all(u.in_place is not None for u in quantized)
    assert not any(engine.store.state.swap.entry(u.param_key) for u in quantized)  # nothing of it copied
    ref = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(directory, device_map="cpu"),
                              peft.LoraConfig(**LORA)).train()
    start = engine.full_state_dict()
    ref.load_state_dict({k: v for k, v in start.items() if "lora_" in k}, strict=False)
    data = token_batches(4)
    assert_close_losses(engine_steps(engine, data[:2]), plain_steps(ref, data[:2]), rel=1e-4)
    engine.save_checkpoint(str(tmp_path / "ckpt"), "two")
    expected = engine_steps(engine, data[2:])
    engine.close()
    resumed = outcore.Engine(peft.get_peft_model(deferred(directory), peft.LoraConfig(**LORA)),
                             outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", grad_clip=None,
                                            nvme_dir=str(tmp_path / "nvme2")), outcore.AdamW(**HP), weights=directory)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert engine_steps(resumed, data[2:]) == expected
    resumed.close()
    assert {f: file_checksum(os.path.join(directory, f)) for f in files} == files


def test_a_merged_export_of_a_pre_quantized_base_is_a_plain_model_of_the_dequantized_weights(tmp_path):
    directory = _pre_quantized(save_model("llama", str(tmp_path / "m")), str(tmp_path / "q"))
    engine = outcore.Engine(peft.get_peft_model(deferred(directory), peft.LoraConfig(**LORA)),
                            outcore.Config(offload_params="nvme", offload_optimizer="nvme",
                                           nvme_dir=str(tmp_path / "nvme")), outcore.AdamW(**HP), weights=directory)
    engine_steps(engine, token_batches(2))
    engine.export(str(tmp_path / "merged"), merge_adapters=True)
    x = token_batches(1)[0]
    with torch.no_grad():
        ours = engine(input_ids=x).logits
    engine.close()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert not any(type(m).__name__ == "Linear4bit" for m in merged.modules())
    assert all(v.dtype == torch.float32 for v in merged.state_dict().values())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, ours, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
def test_on_a_gpu_the_base_is_quantized_and_decoded_there_as_bitsandbytes_does(tmp_path):
    directory = save_model("llama", str(tmp_path / "m"))
    config = outcore.Config(stage=3, offload_params="cpu", offload_optimizer="cpu", grad_clip=None,
                            quantize="nf4", quantize_double=True)
    engine = outcore.Engine(peft.get_peft_model(deferred(directory), peft.LoraConfig(**LORA)), config,
                            outcore.AdamW(**HP), weights=directory, device="cuda")
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                        bnb_4bit_compute_dtype=torch.float32)
    ref = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=q, dtype=torch.float32, device_map="cuda"), peft.LoraConfig(**LORA)).train()
    ref.load_state_dict({k: v for k, v in engine.full_state_dict().items() if "lora_" in k}, strict=False)
    x = token_batches(1)[0].cuda()
    with torch.no_grad():
        torch.testing.assert_close(engine(input_ids=x).logits, ref(input_ids=x).logits, rtol=1e-4, atol=1e-4)
    engine.close()
