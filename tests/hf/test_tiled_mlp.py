"""hf/tiled_mlp.py: a decoder whose MLPs run over tiles of the sequence equals the untiled model
(1e-6 relative in fp32) in its loss and every gradient, with LoRA adapters inside the MLP, and trains
under the engine with checkpointing as the untiled model does; what cannot be tiled is refused."""

import os
import sys

import pytest
import torch

import outcore
from outcore.hf.tiled_mlp import install_tiled_mlp

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from hf_models import VOCAB, config  # noqa: E402


def _model(kind="llama", lora=False):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(kind))
    if lora:
        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                           init_lora_weights=False))
    return model


def _ids(seed=0):
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("tile", [1, 5, 12])
def test_a_tiled_decoder_equals_the_untiled_one(lora, tile):
    plain, ours = _model(lora=lora), _model(lora=lora)
    assert install_tiled_mlp(ours, tile) == 2
    ids = _ids()
    want, got = plain(input_ids=ids, labels=ids).loss, ours(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    want.backward()
    got.backward()
    for (name, p), q in zip(plain.named_parameters(), ours.parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_under_the_engine_with_checkpointing_it_trains_as_the_untiled_model(tmp_path):
    losses = {}
    for tile in (None, 5):
        model = _model(lora=True)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if tile:
            install_tiled_mlp(model, tile)
        engine = outcore.Engine(model, outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme",
                                                      nvme_dir=str(tmp_path / str(tile))), outcore.AdamW(lr=1e-2))
        runs = []
        for step in range(3):
            ids = _ids(step)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            runs.append(float(loss.detach()))
        losses[tile] = runs
        engine.close()
    assert losses[5] == pytest.approx(losses[None], rel=1e-5)


def test_what_cannot_be_tiled_is_refused():
    model = _model()
    model.model.layers[0].mlp.dropout = torch.nn.Dropout(0.1)
    with pytest.raises(ValueError, match=r"has dropout \(p=0.1\).* \(lora_dropout=0\)"):
        install_tiled_mlp(model, 4)
    with pytest.raises(ValueError, match="no decoder layer with an `mlp`"):
        install_tiled_mlp(torch.nn.Sequential(torch.nn.Linear(2, 2)), 4)
