"""Issue 72, item 3: `outcore estimate --generate TOKENS` says the KV cache a generated sequence holds
and the largest generation batch whose cache fits beside the budgets."""

import json

import transformers

from outcore.hf.generation import kv_bytes, kv_width
from outcore.tools.cli import main


def test_the_key_value_width_follows_grouped_query_attention():
    gqa = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    assert kv_width(gqa) == 8 * 128
    assert kv_width(transformers.GPT2Config(n_embd=768, n_head=12)) == 768
    assert kv_bytes(layers=32, width=1024, tokens=8192, dtype="bf16") == 2 * 32 * 1024 * 8192 * 2  # 1 GiB


def test_estimate_generate_says_the_largest_batch_whose_cache_fits(tmp_path, capsys):
    directory = tmp_path / "m"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000,
        "max_position_embeddings": 4096, "tie_word_embeddings": False}))
    report = tmp_path / "e.json"
    assert main(["estimate", "--model", str(directory), "--lora", "8", "--generate", "1024", "--max-memory", "2G",
                 "--dtype", "bf16", "--nvme-dir", str(tmp_path), "--json", str(report)]) == 0
    got = json.load(open(report))["generation"]
    one = 2 * 4 * (2 * 64) * 1024 * 2  # layers x key and value x width 128 x tokens x bf16
    assert got["kv_bytes_per_sequence"] == one
    assert got["batch"] * one <= got["room"] < (got["batch"] + 1) * one and got["batch"] > 0
    assert f"a generation batch (prompts x num_generations) of up to {got['batch']:,} fits" in capsys.readouterr().out
