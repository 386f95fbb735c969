"""Round 4, items 4, 5 (a config.json that disagrees with its tensors) and 8, and the small one on NaN:
a pre-quantized directory whose stored parts are wrong is refused in one line naming the file and the
tensor, before a step trains on weights that decode to zeros or NaN."""

import json
import os
import sys

import pytest
import torch

from outcore.tools.cli import main

bnb = pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from hf_models import STORY, save_model, save_tokenizer  # noqa: E402

WEIGHT = "model.layers.0.mlp.up_proj.weight"
ADAPTED = "base_model.model.model.layers.0.mlp.up_proj.base_layer.weight"  # the same weight under peft


def _quantized(tmp_path_factory, name, q):
    base = save_model("llama", str(tmp_path_factory.mktemp(name) / "base"))
    save_tokenizer(base)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, quantization_config=q, dtype=torch.float32,
                                                              device_map="cpu")
    target = str(tmp_path_factory.mktemp(name) / "q")
    model.save_pretrained(target)
    save_tokenizer(target)
    return target


@pytest.fixture(scope="module")
def nf4_dir(tmp_path_factory):
    return _quantized(tmp_path_factory, "nf4", transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32))


@pytest.fixture(scope="module")
def int8_dir(tmp_path_factory):
    return _quantized(tmp_path_factory, "int8", transformers.BitsAndBytesConfig(load_in_8bit=True))


def _copy_with(source, target, change):
    """`source` copied to `target` with `change(tensors)` applied to its one weights file's tensors."""
    os.makedirs(target)
    for name in os.listdir(source):
        if not name.endswith(".safetensors"):
            with open(os.path.join(source, name), "rb") as f, open(os.path.join(target, name), "wb") as g:
                g.write(f.read())
    tensors = safetensors_torch.load_file(os.path.join(source, "model.safetensors"))
    change(tensors)
    safetensors_torch.save_file(tensors, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    return str(target)


def _state_edited(edit):
    def change(tensors):
        key = next(k for k in tensors if k.startswith(WEIGHT + ".quant_state"))
        state = json.loads(bytes(tensors[key].tolist()).decode())
        edit(state)
        tensors[key] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    return change


def _train(directory, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": STORY}) + "\n" for _ in range(8)))
    code = main(["train", "--model", directory, "--data", str(data), "--lora", "2", "--steps", "1", "--batch", "1",
                 "--seq", "16", "--dtype", "fp32", "--no-save", "--out", str(tmp_path / "run")])
    return code, capsys.readouterr().err.strip()


def _set(key_suffix, value):
    def change(tensors):
        tensors[WEIGHT + key_suffix] = torch.full_like(tensors[WEIGHT + key_suffix], value)
    return change


@pytest.mark.slow
@pytest.mark.parametrize("change, said", [
    (_set(".quant_map", 0.0), f"'{WEIGHT}.quant_map' is not bitsandbytes' nf4 code table"),
    (_set(".nested_quant_map", 0.0), f"'{WEIGHT}.nested_quant_map' is not bitsandbytes' dynamic code table"),
    (_state_edited(lambda s: s.pop("nested_offset")), "gives the nested scales' offset None"),
    (_state_edited(lambda s: s.update(nested_offset="x")), "gives the nested scales' offset 'x'"),
    (_state_edited(lambda s: s.update(nested_offset=float("nan"))), "gives the nested scales' offset nan"),
    (_state_edited(lambda s: s.pop("shape")), "gives the shape None"),
    (_state_edited(lambda s: s.update(shape=32)), "gives the shape 32"),
    (_set(".nested_absmax", float("nan")), f"the frozen base's {ADAPTED}: its stored nested_absmax holds NaN or inf"),
], ids=["quant_map", "nested_quant_map", "no_offset", "offset_text", "offset_nan", "no_shape", "shape_int",
        "nested_absmax_nan"])
def test_a_damaged_nf4_layer_is_refused_naming_its_tensor(nf4_dir, tmp_path, capsys, change, said):
    code, err = _train(_copy_with(nf4_dir, tmp_path / "bad", change), tmp_path, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and said in err, err
    assert "diverged" not in err


@pytest.mark.slow
def test_nan_in_an_int8_layer_s_row_scales_names_the_tensor(int8_dir, tmp_path, capsys):
    module = WEIGHT.removesuffix(".weight")
    code, err = _train(_copy_with(int8_dir, tmp_path / "bad", _set_module(module + ".SCB", float("nan"))), tmp_path,
                       capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"base's {ADAPTED}: its stored SCB holds NaN" in err and "diverged" not in err


def _set_module(key, value):
    def change(tensors):
        tensors[key] = torch.full_like(tensors[key], value)
    return change


@pytest.mark.slow
@pytest.mark.parametrize("declared, said", [
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": True}, "says fp4 with double"),
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False},
     "says nf4, and its weights files hold nf4 with double"),
    ({"load_in_8bit": True}, "says int8, and its weights files hold nf4 with double quantization"),
])
def test_a_quantization_config_that_disagrees_with_the_files_is_refused(nf4_dir, tmp_path, capsys, declared, said):
    def unchanged(tensors):
        pass

    bad = _copy_with(nf4_dir, tmp_path / "bad", unchanged)
    config = json.load(open(os.path.join(bad, "config.json")))
    config["quantization_config"] = {**config["quantization_config"], "load_in_4bit": False, "load_in_8bit": False,
                                     **declared}
    json.dump(config, open(os.path.join(bad, "config.json"), "w"))
    code, err = _train(bad, tmp_path, capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "config.json's quantization_config " + said in err, err


@pytest.mark.slow
def test_the_undamaged_directory_trains(nf4_dir, tmp_path, capsys):
    code, err = _train(nf4_dir, tmp_path, capsys)
    assert code == 0, err
