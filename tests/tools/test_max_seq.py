"""Issue 71, item 4 (in part): `outcore estimate --max-seq` says the longest context whose activations
fit beside the recommended budgets, and `outcore train`'s preflight takes that --seq and refuses a
longer one, naming the longest when no batch fits."""

import json

import psutil
import pytest

from outcore.tools.activations import Shape, preflight
from outcore.tools.cli import main
from outcore.tools.estimate_verdict import Machine, longest_context, verdict
from outcore.tools.memory_bound import SLACK

GIB = 1 << 30


def test_the_longest_context_is_what_the_preflight_takes(tmp_path):
    units, layout = [50_000_000] * 8 + [130_000_000], {"frozen": [True] * 8 + [False], "frozen_in_files": True}
    box = Machine(64 * GIB, 16 * GIB, None, 0, str(tmp_path), 1 << 40)
    v = verdict(units, layout, box, dtype="bf16", state_dtype="fp32", world=1, prefetch_depth=2,
                sub_group_size=1 << 22, grad_clip=1.0, device="cpu", activations=0)
    shape = Shape(8, 1024, 128_256)
    seq, lines = longest_context(v, box, shape, batch=1, dtype="bf16", checkpointed=True, device="cpu",
                                 max_memory=6 * GIB)
    assert seq > 1000 and f"--seq {seq:,} at --batch 1" in lines[0] and f"--seq {seq} " in lines[1]
    slack = int(6 * GIB * SLACK)  # what train keeps of --max-memory beside its figures, as the estimate does
    budgets = v.device_budget + v.host_budget + psutil.Process().memory_info().rss + slack
    kw = dict(batch=1, dtype="bf16", checkpointed=True, budgets=budgets, max_memory=6 * GIB)
    preflight(shape, seq=seq, **kw)  # fits
    with pytest.raises(ValueError, match=r"no --batch fits at --seq \d+: give --seq \d+ or less"):
        preflight(shape, seq=int(seq * 1.1), **kw)


def test_estimate_max_seq_on_a_model_directory(tmp_path, capsys):
    directory = tmp_path / "m"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 32000,
        "max_position_embeddings": 4096, "tie_word_embeddings": False}))
    assert main(["estimate", "--model", str(directory), "--lora", "8", "--max-seq", "--max-memory", "4G",
                 "--nvme-dir", str(tmp_path), "--json", str(tmp_path / "e.json")]) == 0
    out = capsys.readouterr().out
    got = json.load(open(tmp_path / "e.json"))["max_seq"]
    assert got > 0 and f"longest context: --seq {got:,} at --batch 1" in out and "of --max-memory 4.0 GiB" in out
