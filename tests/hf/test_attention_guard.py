"""hf/attention_guard.py, under the engine: at long context, eager attention and a 4-D attention
mask (packed or padded rows) are refused in one line with the fix; SDPA on one unpadded sample a row
runs, and so does anything below the threshold."""

import os
import sys

import pytest
import torch

import outcore
from outcore.hf import attention_guard

transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from hf_models import VOCAB, config  # noqa: E402


def _engine(implementation):
    c = config("llama")
    c._attn_implementation = implementation
    torch.manual_seed(0)
    return outcore.Engine(transformers.AutoModelForCausalLM.from_config(c), outcore.Config(stage=3))


def _ids(seq=12):
    return torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))


def test_long_context_attention_that_holds_seq_by_seq_is_refused(monkeypatch):
    monkeypatch.setattr(attention_guard, "LONG_CONTEXT", 8)
    eager = _engine("eager")
    with pytest.raises(ValueError, match=r"eager attention at 12 tokens holds a 12 x 12 score matrix .* "
                                         r"attn_implementation='sdpa'"):
        eager(input_ids=_ids())
    eager.close()
    sdpa = _engine("sdpa")
    packed = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])  # two samples in one row
    with pytest.raises(ValueError, match=r"a 12 x 12 attention mask at 12 tokens \(packed rows .* one sample each"):
        sdpa(input_ids=_ids(), position_ids=packed, use_cache=False)  # (training keeps no cache)
    ids = _ids()
    loss = sdpa(input_ids=ids, labels=ids).loss  # one sample a row: is_causal, no mask
    assert torch.isfinite(loss)
    sdpa.close()


def test_below_the_threshold_everything_runs():
    eager = _engine("eager")
    ids = _ids()
    assert torch.isfinite(eager(input_ids=ids, labels=ids).loss)
    eager.close()
