"""The context kit: both peers train one sample each in their own process and report a step's
seconds and peak RSS; a process past the bound is stopped and its row says so."""

import pytest

pytest.importorskip("peft")

from outcore.tools.kit.bench_context import SHAPE, estimated_longest, model_dir, one_run, summarize  # noqa: E402

SMALL = {**SHAPE, "vocab_size": 8192, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.slow
def test_both_peers_train_and_one_past_the_bound_is_stopped(tmp_path):
    model = model_dir(str(tmp_path), SMALL)
    root = str(tmp_path)
    rows = [one_run(kind, model, root, 64, 2, None, [], 300) for kind in ("plain", "outcore")]
    assert [r["code"] for r in rows] == [0, 0] and all(r["seconds"] > 0 and r["peak_rss"] > 0 for r in rows)
    stopped = one_run("plain", model, root, 64, 1, 64 << 20, [], 300)  # 64 MiB: less than torch alone
    assert stopped["code"] == -9 and stopped["why"] == "over --max-memory" and stopped["seconds"] is None
    summary = summarize([*rows, stopped], ["plain", "outcore"], [64])
    assert summary["longest"] == {"plain": 64, "outcore": 64}
    assert [r["trained"] for r in summary["rows"]] == ["1/2", "1/1"]
    assert estimated_longest(model, root, 4 << 30) > 64  # what the estimate says, beside what was measured
