"""A Hugging Face encoder-decoder (T5) under the engine: both stacks paged block by block, training
equal to plain AdamW, `generate()` (which runs the encoder on its own first) and `train_batch`."""

import pytest
import torch
import transformers
from helpers import assert_losses_match, assert_same_weights, engine_kwargs_steps, plain_kwargs_steps

import outcore

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def save_t5(directory):
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=2,
                                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(cfg).save_pretrained(directory)
    return directory


def pairs(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 64, (2, 10), generator=g),
             "labels": torch.randint(1, 64, (2, 7), generator=g)} for _ in range(n)]

def engine(directory, nvme_dir, accum=1, wrap=lambda model: model):
    """The T5 of `directory` under the engine (`wrap`: what to make of the model first, peft's LoRA)."""
    with outcore.deferred_init():
        model = transformers.AutoModelForSeq2SeqLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(nvme_dir),
                         grad_clip=None, grad_accumulation=accum, sub_group_size=4096)
    return outcore.Engine(wrap(model), cfg, outcore.AdamW(**HP), weights=directory)


def test_t5_pages_both_stacks_trains_as_plain_adamw_and_generates_the_same(tmp_path):
    directory = save_t5(str(tmp_path / "t5"))
    plain = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory)
    data = pairs(4)
    want = plain_kwargs_steps(plain, data, HP)
    ours = engine(directory, tmp_path / "nvme")
    assert [u.plan.name for u in ours.units] == [*(f"encoder.block.{i}" for i in range(3)),
                                                 *(f"decoder.block.{i}" for i in range(2)), ""]
    assert_losses_match(engine_kwargs_steps(ours, data), want, rel=1e-5)
    trained = ours.full_state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)
    plain.eval()
    ours.eval()
    with torch.no_grad():  # the encoder runs first, called on its own: it gathers the root unit itself
        generated = ours.module.generate(data[0]["input_ids"], max_new_tokens=6, do_sample=False)
        assert torch.equal(generated, plain.generate(data[0]["input_ids"], max_new_tokens=6, do_sample=False))
    ours.close()

@pytest.mark.slow
def test_t5_train_batch_equals_accumulation(tmp_path):
    """The decoder stack carries a config of its own whose key/value cache stayed on: the recomputed
    decoder blocks appended to it twice, and torch's checkpoint failed on the count of saved tensors."""
    k = 2
    directory = save_t5(str(tmp_path / "t5"))
    data = pairs(2 * k)
    ref = engine(directory, tmp_path / "ref", accum=k)
    want = engine_kwargs_steps(ref, data)
    ours = engine(directory, tmp_path / "ours")
    got = [loss for s in range(2) for loss in ours.train_batch(data[s * k:(s + 1) * k])["losses"]]
    assert_losses_match(got, want, rel=1e-5)
    assert_same_weights(ref, ours)
    assert transformers.AutoConfig.from_pretrained(directory).use_cache  # restored on the model's configs too
    assert ours.module.decoder.config.use_cache and ours.module.config.use_cache
    ref.close()
    ours.close()


def test_t5_with_lora_trains_and_generates_as_peft_does_and_exports_merged(tmp_path):
    """Under peft the encoder that generate() calls on its own is two wrappers deep."""
    peft = pytest.importorskip("peft")
    directory = save_t5(str(tmp_path / "t5"))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"], lora_dropout=0.0, init_lora_weights=False,
                           task_type="SEQ_2_SEQ_LM")
    ours = engine(directory, tmp_path / "nvme", wrap=lambda model: peft.get_peft_model(model, lora))
    ref = peft.get_peft_model(transformers.AutoModelForSeq2SeqLM.from_pretrained(directory), lora)
    ref.load_state_dict({k: v for k, v in ours.full_state_dict().items() if "lora_" in k}, strict=False)
    data = pairs(3)
    assert_losses_match(engine_kwargs_steps(ours, data), plain_kwargs_steps(ref, data, HP), rel=1e-5)
    ours.eval()
    ref.eval()
    prompt = pairs(1, seed=5)[0]["input_ids"]
    with torch.no_grad():
        assert torch.equal(ours.module.generate(input_ids=prompt, max_new_tokens=5, do_sample=False),
                           ref.generate(input_ids=prompt, max_new_tokens=5, do_sample=False))
    ours.export(str(tmp_path / "merged"), merge_adapters=True)  # the tied embeddings stored once
    merged = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "merged")).eval()
    ref.load_state_dict(ours.full_state_dict(), strict=True)
    ours.close()
    by_peft = ref.merge_and_unload()
    with torch.no_grad():
        assert torch.equal(merged(**data[0]).logits, by_peft(**data[0]).logits)
