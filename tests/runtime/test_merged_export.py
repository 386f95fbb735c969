"""A LoRA model exported with its adapters merged into the base model: the tensors that peft's
`merge_and_unload()` gives, bit for bit, under the base model's names, in a directory that
`from_pretrained` loads alone; and the adapters whose merge is not a plain sum refused by name."""

import os
import subprocess
import warnings

import pytest
import torch
from dist_merged_export import lora_config
from hf_models import deferred, files, save_model, token_batches
from launch import torchrun
from safetensors.torch import load_file
from test_multirank import HERE
from transformers import AutoModelForCausalLM

import outcore
from outcore.tools.export import export_checkpoint

peft = pytest.importorskip("peft")

HP = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def nvme_config(tmp_path) -> outcore.Config:
    return outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"),
                          grad_clip=None)


def trained_engine(tmp_path, kind: str, lora) -> tuple[outcore.Engine, str]:
    """A peft model of `kind` trained three steps under the engine, checked against plain peft and
    AdamW from the same start."""
    directory = save_model(kind, str(tmp_path / "m"))
    engine = outcore.Engine(peft.get_peft_model(deferred(directory), lora), nvme_config(tmp_path),
                            outcore.AdamW(**HP), weights=directory)
    start = engine.full_state_dict()
    for name, value in start.items():  # peft's initialization: the adapted model starts as the base model
        if ".lora_B." in name or ".lora_embedding_A." in name:
            assert not value.any(), name
    train_beside_plain_peft(engine, directory, lora)  # so that every adapter's B is no longer zero
    return engine, directory


def train_beside_plain_peft(engine: outcore.Engine, directory: str, lora) -> None:
    """Three steps under the engine and of plain peft with AdamW from the engine's start: equal losses."""
    train_beside(engine, peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory), lora), token_batches(3))


def train_beside(engine: outcore.Engine, plain: torch.nn.Module, batches: list[torch.Tensor]) -> None:
    """A step per batch under the engine and of `plain` (the same model in plain PyTorch, given the
    engine's start) with AdamW: equal losses."""
    plain.load_state_dict(engine.full_state_dict(), strict=True)
    opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], **HP)
    for x in batches:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        expected = plain(input_ids=x, labels=x).loss
        expected.backward()
        opt.step()
        opt.zero_grad()
        assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())


def merged_reference(engine: outcore.Engine, directory: str, lora) -> torch.nn.Module:
    """The engine's trained peft model built plainly, merged by peft."""
    ref = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory), lora)
    ref.load_state_dict(engine.full_state_dict(), strict=True)
    return ref.merge_and_unload().eval()


CASES = {
    "llama-tied, q and v": ("llama-tied", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
    "llama, embedding, rsLoRA, lm_head trained whole": (
        "llama", dict(r=4, lora_alpha=16, use_rslora=True, target_modules=["embed_tokens", "o_proj", "down_proj"],
                      modules_to_save=["lm_head"])),
    "gpt2, Conv1D with lora_bias": ("gpt2", dict(r=2, lora_alpha=4, target_modules=["c_attn", "c_fc"],
                                                  lora_bias=True, fan_in_fan_out=True)),
    "llama, DoRA": ("llama", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                  use_dora=True)),
    "llama, trainable tokens of the embedding and the head": (
        "llama", dict(r=2, target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [3, 5, 9],
                                                                                "lm_head": [3, 5, 9]})),
    "llama-tied, trainable tokens": ("llama-tied", dict(r=2, target_modules=["v_proj"],
                                                         trainable_token_indices={"embed_tokens": [2, 7]})),
    "gpt2, Conv1D with DoRA": ("gpt2", dict(r=2, lora_alpha=4, target_modules=["c_attn", "c_proj"],
                                            fan_in_fan_out=True, use_dora=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_merged_export_is_peft_merge_and_unload_bit_for_bit_and_loads_alone(tmp_path, case):
    kind, options = CASES[case]
    lora = peft.LoraConfig(lora_dropout=0.0, **options)
    engine, directory = trained_engine(tmp_path, kind, lora)
    ref = merged_reference(engine, directory, lora)
    expected = ref.state_dict()
    assert any(not torch.equal(expected[k], v) for k, v in load_file(os.path.join(directory, "model.safetensors"))
               .items()), "the adapters changed nothing: the test would prove nothing"

    out = tmp_path / "merged"
    engine.export(str(out), merge_adapters=True, max_shard_size=40_000)
    assert "config.json" in files(out) and "model.safetensors.index.json" in files(out)
    stored = {}
    for name in files(out):
        if name.endswith(".safetensors"):
            stored.update(load_file(os.path.join(out, name)))
    tied = {"lm_head.weight"} if getattr(ref.config, "tie_word_embeddings", False) else set()
    assert set(stored) == set(expected) - tied
    for name, value in stored.items():
        assert torch.equal(value, expected[name]), name

    back, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    x = token_batches(1, seed=9)[0]
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(x).logits, ref(x).logits, rtol=0, atol=0)

    one_file = tmp_path / "merged.safetensors"  # every name, tied ones included
    engine.export(str(one_file), merge_adapters=True)
    assert load_file(str(one_file)).keys() == expected.keys()

    # The adapters alone load in peft onto the base model and give the trained model's logits.
    engine.export(str(tmp_path / "adapters"), adapters_only=True)
    unmerged = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory), lora)
    unmerged.load_state_dict(engine.full_state_dict(), strict=True)
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(directory), str(tmp_path / "adapters"))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x).logits, unmerged.eval()(x).logits, rtol=0, atol=0)

    # Offline, from a checkpoint (meta.json records the merge): the same files, and the tokenizer of the
    # model directory the run came from, which meta.json records too.
    engine.save_checkpoint(str(tmp_path / "ckpt"), "final")
    engine.close()
    res = export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "offline"), merge_adapters=True,
                            max_shard_size=40_000)
    tokenizer = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}
    assert set(files(tmp_path / "offline")) - set(files(out)) <= tokenizer
    assert set(files(out)) <= set(files(tmp_path / "offline"))
    assert (res["tokenizer_from"] is not None) == ("tokenizer.json" in files(tmp_path / "offline"))
    for name in files(out):
        if name.endswith(".safetensors"):
            offline = load_file(os.path.join(tmp_path / "offline", name))
            assert offline.keys() == load_file(os.path.join(out, name)).keys()
            for key, value in offline.items():
                assert torch.equal(value, expected[key]), key


@pytest.mark.parametrize("options", [dict(target_modules=["q_proj", "v_proj", "embed_tokens"]),
                                     dict(target_modules=["q_proj", "v_proj"], use_dora=True)])
def test_a_bf16_run_merges_as_peft_does_and_offline_the_same(tmp_path, options):
    """peft keeps adapters in fp32 under a bf16 base and rounds a Linear's merged sum once (DoRA's
    rescaled sum too), an Embedding's delta first; an embedding's factors, drawn under
    deferred_init(), are peft's randn."""
    directory = save_model("llama", str(tmp_path / "m"))
    lora = peft.LoraConfig(r=4, init_lora_weights=False, **options)
    config = outcore.Config(stage=3, dtype="bf16", offload_params="nvme", offload_optimizer="nvme",
                            nvme_dir=str(tmp_path / "nvme"))
    engine = outcore.Engine(peft.get_peft_model(deferred(directory), lora), config, outcore.AdamW(lr=1e-3),
                            weights=directory)
    for name, value in engine.full_state_dict().items():
        if ".lora_embedding_" in name:  # not left as the memory they were given
            assert torch.isfinite(value).all() and 0.8 < float(value.float().std()) < 1.25, name
    for x in token_batches(2):
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    state = engine.full_state_dict()
    engine.export(str(tmp_path / "merged"), merge_adapters=True)
    engine.save_checkpoint(str(tmp_path / "ckpt"), "final")
    engine.close()
    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "offline"), merge_adapters=True)
    ref = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16), lora)
    ref.load_state_dict(state, strict=True)
    expected = ref.merge_and_unload().state_dict()
    for out in ("merged", "offline"):
        stored = load_file(str(tmp_path / out / "model.safetensors"))
        assert stored.keys() == expected.keys()
        for name, value in stored.items():
            assert value.dtype == torch.bfloat16 and torch.equal(value, expected[name]), (out, name)


@pytest.mark.parametrize(("kind", "options", "message"), [
    ("llama", dict(target_modules=["embed_tokens"], use_dora=True), r"'model\.embed_tokens' is a DoraEmbeddingVariant"),
    ("llama-tied", dict(target_modules=["lm_head"]), "'lm_head.weight' is tied to 'model.embed_tokens.weight'"),
])
def test_an_adapter_whose_merge_is_not_a_plain_sum_is_refused_by_name_and_nothing_is_written(tmp_path, kind, options,
                                                                                            message):
    directory = save_model(kind, str(tmp_path / "m"))
    with warnings.catch_warnings():  # peft warns of an adapter on a tied weight
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory), peft.LoraConfig(r=2, **options))
    engine = outcore.Engine(model, nvme_config(tmp_path), outcore.AdamW(**HP))
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=message):
        engine.export(str(out), merge_adapters=True)
    assert files(out) == ["tokenizer.json"]
    engine.export(str(tmp_path / "adapters"), adapters_only=True)  # what the error says to do instead
    assert "adapter_model.safetensors" in files(tmp_path / "adapters")
    engine.save_checkpoint(str(tmp_path / "ckpt"), "final")
    engine.close()
    with pytest.raises(ValueError, match=message):  # offline, the checkpoint's record says the same
        export_checkpoint(str(tmp_path / "ckpt"), str(out), merge_adapters=True)
    assert files(out) == ["tokenizer.json"]


def test_merge_adapters_asks_for_a_peft_model_and_not_with_adapters_only(tmp_path):
    directory = save_model("llama", str(tmp_path / "m"))
    engine = outcore.Engine(deferred(directory), nvme_config(tmp_path), weights=directory)
    with pytest.raises(ValueError, match="not a peft model"):
        engine.export(str(tmp_path / "a"), merge_adapters=True)
    with pytest.raises(ValueError, match="ask for one of them"):
        engine.export(str(tmp_path / "b"), merge_adapters=True, adapters_only=True)
    engine.save_checkpoint(str(tmp_path / "ckpt"), "final")
    engine.close()
    with pytest.raises(ValueError, match="is not of a LoRA"):
        export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "c"), merge_adapters=True)
    assert not any(os.path.exists(tmp_path / n) for n in "abc")


def test_dora_built_with_its_weights_trains_as_plain_peft(tmp_path):
    """The model loaded whole, then wrapped (peft computes the magnitude), trains as plain peft."""
    directory = save_model("llama", str(tmp_path / "m"))
    dora = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], use_dora=True, lora_dropout=0.0)
    engine = outcore.Engine(peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory), dora),
                            nvme_config(tmp_path), outcore.AdamW(**HP))
    train_beside_plain_peft(engine, directory, dora)
    engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("init", ["pissa"])  # changes adapters and base both; the merge cases: one rank, above
def test_two_ranks_export_the_merge_of_what_they_hold_together(tmp_path, init):
    directory = save_model("llama", str(tmp_path / "m"))
    out = str(tmp_path / "merged")
    cmd = [*torchrun(2, tmp_path), os.path.join(HERE, "dist_merged_export.py"), directory, out, str(tmp_path / "nvme"),
           init]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ref = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory), lora_config(init))
    state = torch.load(out + ".pt", weights_only=True)
    if init != "false":  # the halves the two ranks computed make peft's own start (but A, drawn at random)
        expected_start = ref.state_dict()
        assert state.keys() == expected_start.keys()
        for name, value in state.items():
            if not (init == "tokens" and ".lora_A." in name):
                assert torch.equal(value, expected_start[name]), name
    ref.load_state_dict(state, strict=True)
    expected = ref.merge_and_unload().state_dict()
    stored = load_file(os.path.join(out, "model.safetensors"))
    assert stored.keys() == expected.keys()
    for name, value in stored.items():
        assert torch.equal(value, expected[name]), name
