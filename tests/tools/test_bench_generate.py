"""The generation benchmark: both kinds generate the same tokens (greedy, the same LoRA-wrapped weights)."""

import pytest

pytest.importorskip("peft")

from outcore.tools.kit.bench_generate import run  # noqa: E402
from outcore.tools.kit.bench_pretrained import make_model  # noqa: E402


def test_the_engine_generates_what_the_whole_model_generates(tmp_path):
    model_dir = make_model(str(tmp_path), layers=1, hidden=256)
    plain = run("plain", model_dir, str(tmp_path / "swap"), 128 << 20, batch=2, prompt=4, new=3)
    engine = run("engine", model_dir, str(tmp_path / "swap"), 128 << 20, batch=2, prompt=4, new=3)
    assert engine["generated"] == plain["generated"] and len(plain["generated"][0]) == 3
    assert plain["bytes_read_per_token"] == 0 and engine["s_per_token"] > 0
