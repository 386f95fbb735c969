"""The generation benchmark: the engine's kinds generate the tokens the whole model does (greedy, the
same LoRA-wrapped weights), and the summary sets each against plain's time and the read floor."""

import pytest

pytest.importorskip("peft")

from outcore.tools.kit.bench_generate import run, summary  # noqa: E402
from outcore.tools.kit.bench_pretrained import make_model  # noqa: E402


def test_the_engine_generates_what_the_whole_model_generates_and_the_summary_compares_them(tmp_path):
    model_dir = make_model(str(tmp_path), layers=8, hidden=256)
    rows = {kind: [run(kind, model_dir, str(tmp_path / "swap"), 70 << 20, batch=2, prompt=4, new=3)]
            for kind in ("plain", "resident", "small")}
    assert len(rows["plain"][0]["generated"][0]) == 3 and rows["plain"][0]["bytes_read_per_token"] == 0
    assert rows["resident"][0]["bytes_read_per_token"] == 0  # all of it kept for the call
    small = rows["small"][0]
    assert small["budget_each"] == 70 << 20 and small["bytes_read_per_token"] < small["stored_bytes"]
    out = summary(rows, read_rate=1e9)
    for kind in ("resident", "small"):
        m = out["medians"][kind]
        assert m["same_tokens"]
        assert m["over_plain"] == pytest.approx(rows[kind][0]["s_per_token"] / rows["plain"][0]["s_per_token"])
        assert m["floor_s_per_token"] == pytest.approx(rows[kind][0]["bytes_read_per_token"] / 1e9)
    assert "over_floor" not in out["medians"]["resident"]  # nothing read: no floor to set it against
    assert out["medians"]["small"]["read_share"] == small["bytes_read_per_token"] / small["model_bytes"]
    assert small["model_bytes"] < small["stored_bytes"]  # the bf16 files, read into fp32 units
