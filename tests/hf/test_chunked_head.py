"""hf/chunked_head.py: a causal LM whose labelled forward computes its loss over chunks equals the
model's own loss (1e-6, fp32) for Llama, a tied head and Gemma 2's soft-cap, with and without
`num_items_in_batch`; trains under the engine as the plain model does; generates as before."""

import os
import sys

import pytest
import torch

import outcore
from outcore.hf.chunked_head import install_chunked_loss

transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from hf_models import VOCAB, config  # noqa: E402


def _pair(kind, vocab=VOCAB):
    c = config(kind)
    c.vocab_size = vocab  # 512: the head outweighs a block, and is a unit of its own under the engine
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(c)
    torch.manual_seed(0)
    chunked = transformers.AutoModelForCausalLM.from_config(c)
    install_chunked_loss(chunked, chunk_tokens=5)
    return plain, chunked


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    return ids, labels


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "gemma2"])
@pytest.mark.parametrize("num_items", [None, 17])
def test_the_chunked_loss_is_the_model_s_own(kind, num_items):
    plain, chunked = _pair(kind)
    ids, labels = _batch()
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    want = plain(input_ids=ids, labels=labels, **extra).loss
    out = chunked(input_ids=ids, labels=labels, **extra)
    assert out.logits is None
    torch.testing.assert_close(out.loss, want, rtol=1e-6, atol=1e-7)
    want.backward()
    out.loss.backward()
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_without_labels_the_forward_is_the_model_s_own():
    plain, chunked = _pair("llama")
    ids, _ = _batch()
    torch.testing.assert_close(chunked(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert torch.equal(chunked.generate(ids[:1, :4], max_new_tokens=4, do_sample=False),
                       plain.generate(ids[:1, :4], max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("offload, vocab", [("none", VOCAB), ("nvme", VOCAB), ("nvme", 512)],
                         ids=["resident", "nvme", "head-unit"])
def test_trains_under_the_engine_as_the_plain_model(tmp_path, offload, vocab):
    plain, chunked = _pair("llama", vocab)
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = torch.optim.AdamW(plain.parameters(), **hp)
    engine = outcore.Engine(chunked, outcore.Config(offload_params=offload, offload_optimizer=offload, grad_clip=None,
                                                    nvme_dir=str(tmp_path / "n")), outcore.AdamW(**hp))
    if vocab > VOCAB:
        assert "lm_head" in [u.name for u in engine.units]
    for step in range(3):
        ids, labels = _batch(step)
        want = plain(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        want.backward()
        opt.step()
        got = engine(input_ids=ids, labels=labels).loss
        engine.backward(got)
        engine.step()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    engine.close()


def test_a_head_with_a_bias_is_refused():
    model = transformers.AutoModelForCausalLM.from_config(config("llama"))
    model.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    with pytest.raises(ValueError, match="needs a causal LM with a decoder `model` and a bias-free Linear `lm_head`"):
        install_chunked_loss(model, 8)
