"""The GPU kit's real-shape rows, run here at a tiny width: the model builds from its architecture's
config, trains at the accumulation the step estimate names, and reports its figures beside the
prediction."""

import pytest

from outcore.tools.kit import gpu_shapes

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256)
# the CPU's rates, the AdamW slow enough that compute bounds the step only from a few micro-batches
RATES = dict(disk_read=1e9, disk_write=1e9, flops=1e10, adam=2e7, host_device=None, peak_flops=1e10)


@pytest.mark.parametrize("row", sorted(gpu_shapes.SHAPES))
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


def test_deepspeed_is_named_as_run_or_not():
    assert gpu_shapes.deepspeed_note().startswith("not run: ")
