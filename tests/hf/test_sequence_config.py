"""`Config.loss_chunk_tokens` and `Config.tile_tokens`: the engine has a Hugging Face causal LM compute
its loss over chunks and its MLPs over tiles (given, or "auto"), and trains as the whole model does;
a model outside the family is refused, and so is a value that is not a number of tokens."""

import os
import sys

import pytest
import torch

import outcore

transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from hf_models import VOCAB, config  # noqa: E402


def _losses(tmp_path, name, **pieces):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config("llama"))
    engine = outcore.Engine(model, outcore.Config(offload_params="nvme", offload_optimizer="nvme",
                                                  nvme_dir=str(tmp_path / name), **pieces), outcore.AdamW(lr=1e-2))
    losses, logits = [], []
    for step in range(3):
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(step))
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
        logits.append(out.logits)
    engine.close()
    return losses, logits


@pytest.mark.parametrize("pieces", [{"loss_chunk_tokens": 5, "tile_tokens": 3},
                                    {"loss_chunk_tokens": "auto", "tile_tokens": "auto"}])
def test_the_engine_splits_the_sequence_and_trains_as_the_whole_model(tmp_path, pieces):
    whole, whole_logits = _losses(tmp_path, "whole")
    split, split_logits = _losses(tmp_path, "split", **pieces)
    assert split == pytest.approx(whole, rel=1e-5)
    assert all(t is not None for t in whole_logits) and all(t is None for t in split_logits)  # never whole


def test_a_model_outside_the_family_and_a_wrong_value_are_refused():
    with pytest.raises(ValueError, match="Sequential: loss_chunk_tokens and tile_tokens compute a Hugging Face"):
        outcore.Engine(torch.nn.Sequential(torch.nn.Linear(4, 4)), outcore.Config(tile_tokens=4))
    for bad in (0, "half"):
        with pytest.raises(ValueError, match=r"loss_chunk_tokens=.*: give a number of tokens \(at least 1\), \"auto\""):
            outcore.Config(loss_chunk_tokens=bad)
    with pytest.raises(ValueError, match="tile_tokens=2.5: must be a whole number"):
        outcore.Config(tile_tokens=2.5)
