"""The GPU kit's real-shape rows, run here at a tiny width: the model builds from its architecture's
config, trains at the accumulation the step estimate names, and reports its figures beside the
prediction."""

from dataclasses import replace

import pytest

from outcore.tools.kit import gpu_shapes

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256)
# the CPU's rates, the AdamW slow enough that compute bounds the step only from a few micro-batches
RATES = dict(disk_read=1e9, disk_write=1e9, flops=1e10, adam=2e7, host_device=None, peak_flops=1e10)


@pytest.mark.parametrize("row", sorted(r for r, shape in gpu_shapes.SHAPES.items() if not shape.generations))
def test_a_row_trains_at_the_estimates_accumulation_beside_its_prediction(tmp_path, row):
    r = gpu_shapes.run_row(row, device="cpu", nvme_dir=str(tmp_path), rates=RATES, batch=1, seq=16, steps=1,
                           overrides=TINY)
    predicted = r["predicted"]
    if gpu_shapes.SHAPES[row].long_context:  # one sample a step, its loss over chunks, its MLPs tiled
        assert r["accumulate"] == predicted["accumulate"] == 1 and r["offload_activations"] == "cpu"
    else:
        assert r["accumulate"] == predicted["accumulate"] > 1 and predicted["bound"] == "compute"
    assert r["step_s"] > 0 and r["tokens_per_s"] == pytest.approx(16 * r["accumulate"] / r["step_s"])
    assert r["peak_host_rss_bytes"] > 100 << 20 and 0 < r["MFU"]
    if gpu_shapes.SHAPES[row].lora is None:
        assert r["trained"] == r["params"]
    else:  # the adapters only
        assert 0 < r["trained"] < r["params"] // 2
    assert not list(tmp_path.iterdir())  # the swap folder went with the run


def test_the_generation_row_samples_every_completion_of_its_prompts_in_one_call(tmp_path, monkeypatch):
    shape = gpu_shapes.SHAPES["llama-8b-grpo"]
    monkeypatch.setitem(gpu_shapes.SHAPES, "llama-8b-grpo", replace(shape, new_tokens=4, device_budget=None))
    r = gpu_shapes.run_row("llama-8b-grpo", device="cpu", nvme_dir=str(tmp_path), rates=RATES, batch=2, seq=8,
                           steps=1, overrides=TINY)
    assert r["sequences"] == 2 * shape.generations and r["new_tokens"] == 4
    assert r["tokens_per_s"] == pytest.approx(r["sequences"] / r["s_per_token"])
    assert r["units_kept"] == r["units"] and r["bytes_read_per_token"] == 0  # a tiny model: all of it kept
    assert not list(tmp_path.iterdir())


def test_deepspeed_is_named_as_run_or_not():
    assert gpu_shapes.deepspeed_note().startswith("not run: ")
