"""A model whose vocabulary was resized (`resize_token_embeddings`, tokens added for fine-tuning)
loads the original files with `weights=`: the stored rows as they are, the new rows at the stored
rows' mean, as transformers starts them; it trains as the same model in plain transformers and
exports a directory that loads with the new vocabulary."""

import os

import pytest
import torch
from hf_models import save_model, token_batches
from safetensors.torch import load_file
from test_merged_export import HP, train_beside
from transformers import AutoConfig, AutoModelForCausalLM

import outcore

ADDED = 6


def with_new_tokens(vocab: int) -> list[torch.Tensor]:
    """Three batches in which every third token is one of the ADDED beyond `vocab`."""
    batches = token_batches(3)
    for x in batches:
        x[:, ::3] = vocab + x[:, ::3] % ADDED
    return batches


def resized_deferred(directory: str) -> torch.nn.Module:
    with outcore.deferred_init():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
        # transformers' mean needs the weights, which the engine has once it reads them
        model.resize_token_embeddings(model.config.vocab_size + ADDED, mean_resizing=False)
    return model


@pytest.mark.parametrize("kind", ["llama", "llama-tied"])
def test_new_rows_start_at_the_mean_and_the_model_trains_and_exports_as_plain_transformers(tmp_path, kind, caplog):
    directory = save_model(kind, str(tmp_path / "m"))
    stored = load_file(os.path.join(directory, "model.safetensors"))
    config = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"),
                            grad_clip=None)
    engine = outcore.Engine(resized_deferred(directory), config, outcore.AdamW(**HP), weights=directory)
    grown = [n for n in ("model.embed_tokens.weight", "lm_head.weight") if n in stored]
    said = [r.getMessage() for r in caplog.records if "vocabulary was resized" in r.getMessage()]
    assert len(said) == len(grown) and all(f"{ADDED} new rows" in m for m in said)
    start = engine.full_state_dict()
    for name in grown:
        rows = stored[name].shape[0]
        assert torch.equal(start[name][:rows], stored[name])
        assert torch.equal(start[name][rows:], stored[name].mean(dim=0).expand(ADDED, -1))

    plain = AutoModelForCausalLM.from_pretrained(directory)
    plain.resize_token_embeddings(plain.config.vocab_size + ADDED, mean_resizing=False)
    vocab = plain.config.vocab_size
    train_beside(engine, plain, with_new_tokens(vocab - ADDED))

    out = tmp_path / "out"
    engine.export(str(out))
    engine.close()
    back = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert back.config.vocab_size == vocab and back.get_input_embeddings().weight.shape[0] == vocab
    x = token_batches(1, seed=9)[0]
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, plain.eval()(x).logits, rtol=1e-5, atol=1e-5)


def test_rows_beyond_the_vocabulary_or_fewer_rows_are_still_another_model(tmp_path):
    directory = save_model("llama", str(tmp_path / "m"))
    with outcore.deferred_init():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
        model.resize_token_embeddings(model.config.vocab_size - 2, mean_resizing=False)  # shrunk: not ours to guess
    config = outcore.Config(offload_params="nvme", nvme_dir=str(tmp_path / "nvme"))
    with pytest.raises(ValueError, match=r"'model\.embed_tokens\.weight'.*has shape .*these weights are for another"):
        outcore.Engine(model, config, weights=directory)


def test_lora_trains_the_new_tokens_rows_with_trainable_token_indices(tmp_path):
    """The way peft trains added tokens under LoRA: their rows of the embedding and of the untied
    head, which start at the stored rows' mean."""
    peft = pytest.importorskip("peft")
    directory = save_model("llama", str(tmp_path / "m"))
    stored = load_file(os.path.join(directory, "model.safetensors"))
    vocab = stored["model.embed_tokens.weight"].shape[0]
    new = list(range(vocab, vocab + ADDED))

    def lora():
        return peft.LoraConfig(r=2, target_modules=["q_proj"], trainable_token_indices={"embed_tokens": new,
                                                                                        "lm_head": new})

    with outcore.deferred_init():
        model = peft.get_peft_model(resized_deferred(directory), lora())
    config = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"),
                            grad_clip=None)
    engine = outcore.Engine(model, config, outcore.AdamW(**HP), weights=directory)
    start = engine.full_state_dict()
    for part, name in (("model.embed_tokens", "model.embed_tokens.weight"), ("lm_head", "lm_head.weight")):
        delta = start[f"base_model.model.{part}.token_adapter.trainable_tokens_delta.default"]
        assert torch.equal(delta, stored[name].mean(dim=0).expand(ADDED, -1))

    plain = AutoModelForCausalLM.from_pretrained(directory)
    plain.resize_token_embeddings(vocab + ADDED, mean_resizing=False)
    train_beside(engine, peft.get_peft_model(plain, lora()), with_new_tokens(vocab))
    trained = engine.full_state_dict()
    delta = trained["base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta.default"]
    assert not torch.equal(delta, stored["model.embed_tokens.weight"].mean(dim=0).expand(ADDED, -1))
    engine.close()
