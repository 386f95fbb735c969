"""Issue 70, items 4, 5 and 7: what `outcore train` says of a run as it starts: a quantized base's stored
form and bytes, a default warm-up that fits a short run (and one as long as the run, said), and fp16
on a CPU."""

import json
import os
import sys

import pytest

from outcore.tools.cli import main

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from hf_models import STORY, save_model, save_tokenizer  # noqa: E402

TINY = ["train", "--batch", "2", "--seq", "16", "--eval-batches", "1", "--offload-params", "cpu",
        "--offload-optimizer", "cpu", "--no-save", "--log-every", "1"]


@pytest.mark.slow
def test_a_quantized_base_is_said_with_its_stored_form(tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    model = save_model("llama", str(tmp_path / "llama"))
    save_tokenizer(model)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": STORY}) + "\n" for _ in range(8)))
    assert main(["train", "--model", model, "--data", str(data), "--lora", "2", "--quantize", "nf4",
                 "--quantize-double", "--steps", "1", "--batch", "1", "--seq", "16", "--dtype", "bf16", "--no-save",
                 "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "bf16, the frozen base stored nf4 with double quantization (0.52 bytes a weight)" in out


def test_a_short_run_is_not_all_warm_up(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*TINY, "--steps", "3", "--lr", "0.001", "--json", "s.json"]) == 0
    lrs = [json.loads(line)["lr"] for line in open("outcore-run/log.jsonl")]
    assert lrs[0] == pytest.approx(1e-3)  # was 0, 1e-4, 2e-4 of a 1e-3 peak: ten steps of warm-up in three
    assert "warm-up" not in capsys.readouterr().out.split("lr 0.001")[0]


def test_a_warm_up_as_long_as_the_run_is_said(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*TINY, "--steps", "3", "--warmup-steps", "5"]) == 0
    assert "the warm-up of 5 steps is the whole run of 3: the rate never reaches its peak" in capsys.readouterr().out


def test_fp16_on_a_cpu_is_said(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*TINY, "--steps", "1", "--dtype", "fp16"]) == 0
    assert "dtype fp16 on a CPU: it has no fp16 arithmetic" in capsys.readouterr().out
