"""Issue 70, item 1: the README's QLoRA sequence to its last command. A checkpoint of a run whose frozen
base rested quantized exports, merged: into the original weights where the run read unquantized
files (equal to peft's merge_and_unload on that base, 1e-6 in fp32), into the dequantized ones for a
pre-quantized base (equal to the engine's own merged export); from `outcore train`'s checkpoints and
from a Trainer's checkpoint-N/outcore, for nf4, fp4 and int8."""

import json
import os
import sys

import pytest
import torch

from outcore.tools.cli import main

bnb = pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from hf_models import STORY, save_model, save_tokenizer  # noqa: E402


def _loaded(directory) -> dict[str, torch.Tensor]:
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).state_dict()


def _pre_quantized(base, target, kind):
    q = transformers.BitsAndBytesConfig(load_in_8bit=True) if kind == "int8" else transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_use_double_quant=kind == "nf4",
        bnb_4bit_compute_dtype=torch.float32)
    transformers.AutoModelForCausalLM.from_pretrained(base, quantization_config=q, dtype=torch.float32,
                                                      device_map="cpu").save_pretrained(target)
    save_tokenizer(target)
    return target


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = save_model("llama", str(tmp_path_factory.mktemp("base") / "llama"))
    save_tokenizer(directory)
    return directory


def _train(model, tmp_path, *flags):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": STORY}) + "\n" for _ in range(8)))
    out = tmp_path / "run"
    assert main(["train", "--model", str(model), "--data", str(data), "--lora", "2", "--steps", "2", "--batch", "1",
                 "--seq", "16", "--dtype", "fp32", "--lr", "0.05", "--out", str(out), *flags]) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nf4", "fp4", "int8"])
def test_a_qlora_checkpoint_from_unquantized_files_merges_into_the_original_weights(base, tmp_path, kind):
    out = _train(base, tmp_path, "--quantize", kind, *(["--quantize-double"] if kind == "nf4" else []))
    assert main(["export", str(out / "checkpoints"), str(tmp_path / "merged"), "--merge-adapters"]) == 0
    reference = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(out / "adapters"))
    want = reference.merge_and_unload().state_dict()
    got = _loaded(tmp_path / "merged")
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6, msg=name)
    assert any(not torch.equal(got[n], v) for n, v in _loaded(base).items())  # the adapters moved something


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nf4", "fp4", "int8"])
def test_a_checkpoint_of_a_pre_quantized_base_merges_into_the_dequantized_weights(base, tmp_path, kind):
    quantized = _pre_quantized(base, str(tmp_path / "q"), kind)
    out = _train(quantized, tmp_path, "--merge-adapters", "--offload-params", "cpu")
    assert main(["export", str(out / "checkpoints"), str(tmp_path / "merged"), "--merge-adapters"]) == 0
    want, got = _loaded(out / "model"), _loaded(tmp_path / "merged")  # the engine's own merged export
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_a_trainer_s_qlora_checkpoint_exports_merged(base, tmp_path, kind):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "hf"))
    from trainer_setup import TokenRows, nvme_config, trainer_args

    import outcore

    q = transformers.BitsAndBytesConfig(load_in_8bit=True) if kind == "int8" else transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_compute_dtype=torch.float32)
    trainer = outcore.hf.Trainer(model=base, args=trainer_args(str(tmp_path / "t"), max_steps=2, save_strategy="steps",
                                                               save_steps=2, learning_rate=0.05),
                                 train_dataset=TokenRows(), quantization_config=q,
                                 peft_config=peft.LoraConfig(r=2, target_modules="all-linear"),
                                 outcore_config=nvme_config(str(tmp_path / "nvme")))
    trainer.train()
    trainer.engine.export(str(tmp_path / "engine"), merge_adapters=True)  # what merge_and_unload's message names
    trainer.engine.close()
    checkpoint = tmp_path / "t" / "checkpoint-2" / "outcore"
    assert main(["export", str(checkpoint), str(tmp_path / "merged"), "--merge-adapters"]) == 0
    want, got = _loaded(tmp_path / "engine"), _loaded(tmp_path / "merged")
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6, msg=name)
