"""Issue 70, items 2 and 3: the offload choice counts what a LoRA or QLoRA run keeps (frozen units at
their stored bytes, read in place, with no gradient or optimizer state), `outcore estimate`'s verdict
and `outcore train` choose alike, and where the derived budgets do not fit and smaller ones do, the
verdict says so with those budgets."""

import json
import os
import sys

import pytest

from outcore.tools import estimate_verdict, memory_bound
from outcore.tools.cli import main
from outcore.tools.estimate_verdict import Machine, verdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from hf_models import STORY, save_model, save_tokenizer  # noqa: E402

GIB = 1 << 30
LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
            "tie_word_embeddings": False}


def _available(monkeypatch, n: int) -> None:
    for module in (memory_bound, estimate_verdict):
        monkeypatch.setattr(module, "available_memory", lambda *_a, **_k: n)


@pytest.fixture(scope="module")
def llama_7b(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-7b")
    (directory / "config.json").write_text(json.dumps(LLAMA_7B))
    return str(directory)


def _verdict(capsys, monkeypatch, tmp_path, model, *flags, available):
    _available(monkeypatch, available)
    path = tmp_path / f"e{len(os.listdir(tmp_path))}.json"
    assert main(["estimate", "--model", model, "--nvme-dir", str(tmp_path), "--dtype", "bf16", "--device", "cpu",
                 *flags, "--json", str(path)]) == 0
    capsys.readouterr()
    return json.load(open(path))["verdict"]


@pytest.mark.parametrize("flags, chosen", [(["--lora", "16", "--quantize", "nf4"], ("none", "none")),
                                           (["--lora", "16"], ("nvme", "nvme"))], ids=["qlora", "lora"])
def test_a_7b_lora_run_keeps_in_memory_what_fits(llama_7b, tmp_path, capsys, monkeypatch, flags, chosen):
    """On 20.6 GiB available: the NF4 base (3.5 GB) and the adapters' states fit in half of it, nothing
    offloaded; the bf16 base (13.5 GB) does not, and is read in place from its files (the derived host
    budget then caches what of it fits, which is what the choice counts)."""
    got = _verdict(capsys, monkeypatch, tmp_path, llama_7b, *flags, available=int(20.6 * GIB))
    assert (got["offload_params"], got["offload_optimizer"]) == chosen and got["fits"], got
    # every unit counted as trained (what the choice did before) does not fit: the layout is what decides
    units = [200_000_000] * 32 + [262_000_000]
    params, opt, _ = memory_bound.choose_offload(units, "bf16", 3, 1.0, 2, memory_bound.MemoryBound(None, 0, 0))
    assert (params, opt) != ("none", "none")


def test_a_7b_lora_run_that_does_not_fit_offloads(llama_7b, tmp_path, capsys, monkeypatch):
    got = _verdict(capsys, monkeypatch, tmp_path, llama_7b, "--lora", "16", available=8 * GIB)
    assert got["offload_params"] != "none", got


def test_derived_budgets_too_large_and_smaller_ones_that_fit_are_said(tmp_path):
    """The engine derives its budgets from the memory available, not counting the activations: where
    those then do not fit and the least budgets do, the verdict gives the least ones, said."""
    units = [200_000_000] * 32 + [262_000_000]
    layout = {"frozen": [True] * 32 + [False], "frozen_in_files": True}
    kw = dict(dtype="bf16", state_dtype="fp32", world=1, prefetch_depth=2, sub_group_size=1 << 22, grad_clip=1.0,
              device="cpu", activations=6 * GIB)
    box = Machine(64 * GIB, 12 * GIB, None, 0, str(tmp_path), 1 << 40)
    tight = verdict(units, layout, box, **kw)
    assert tight.derived is not None and tight.fits, tight
    assert tight.device_budget + tight.host_budget + 6 * GIB <= 12 * GIB < sum(tight.derived) + 6 * GIB
    lines = estimate_verdict.verdict_lines(tight, box)
    assert lines[1].startswith("fits at smaller budgets than the derived ones") and "--host-budget" in lines[2]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    directory = save_model("llama", str(tmp_path_factory.mktemp("tiny") / "llama"))
    save_tokenizer(directory)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--lora", "2"], ["--lora", "2", "--quantize", "nf4"]],
                         ids=["full", "lora", "qlora"])
@pytest.mark.parametrize("available", [8 * GIB, 3 << 20], ids=["roomy", "tight"])
def test_train_chooses_what_the_verdict_recommends(tiny_llama, tmp_path, capsys, monkeypatch, flags, available):
    if "nf4" in flags:
        pytest.importorskip("bitsandbytes")
    got = _verdict(capsys, monkeypatch, tmp_path, tiny_llama, *flags, available=available)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": STORY}) + "\n" for _ in range(8)))
    assert main(["train", "--model", tiny_llama, "--data", str(data), *flags, "--steps", "1", "--batch", "1",
                 "--seq", "16", "--dtype", "bf16", "--no-save", "--out", str(tmp_path / "run"),
                 "--json", str(tmp_path / "t.json")]) == 0
    ran = json.load(open(tmp_path / "t.json"))
    assert (ran["offload_params"], ran["offload_optimizer"]) == (got["offload_params"], got["offload_optimizer"])
