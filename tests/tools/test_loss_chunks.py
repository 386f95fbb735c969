"""`outcore train --model DIR --loss-chunk-tokens N`: the loss over chunks (hf/chunked_head.py) gives
the run's losses as without it (fp32, LoRA and full), and a preset is refused."""

import json
import os
import sys

import pytest

from outcore.tools.cli import main

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from hf_models import STORY, save_model, save_tokenizer  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("lora", [[], ["--lora", "2"]], ids=["full", "lora"])
def test_a_run_over_loss_chunks_equals_the_whole_loss(tmp_path, lora, capsys):
    model = save_model("llama", str(tmp_path / "llama"))
    save_tokenizer(model)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": STORY}) + "\n" for _ in range(16)))
    run = ["train", "--model", model, "--data", str(data), *lora, "--steps", "3", "--batch", "2", "--seq", "16",
           "--dtype", "fp32", "--no-save", "--log-every", "1"]
    whole_run = [*run, "--loss-chunk-tokens", "0", "--out", str(tmp_path / "a"), "--json", str(tmp_path / "a.json")]
    assert main(whole_run) == 0
    assert "sequence: whole logits, MLPs whole" in capsys.readouterr().out
    chunked_run = [*run, "--loss-chunk-tokens", "5", "--out", str(tmp_path / "b"), "--json", str(tmp_path / "b.json")]
    assert main(chunked_run) == 0
    # by default the loss is over chunks chosen from the vocabulary, and the MLPs whole at this length
    assert main([*run, "--out", str(tmp_path / "c"), "--json", str(tmp_path / "c.json")]) == 0
    assert "sequence: the loss over chunks of 8,192 tokens, MLPs whole" in capsys.readouterr().out
    whole, chunked, chosen = (json.load(open(tmp_path / f"{n}.json")) for n in "abc")
    for run_ in (chunked, chosen):
        assert run_["losses"] == pytest.approx(whole["losses"], rel=1e-5)
        assert [v for _, v in run_["val_losses"]] == pytest.approx([v for _, v in whole["val_losses"]], rel=1e-5)


def test_a_preset_is_refused(tmp_path, capsys):
    assert main(["train", "--loss-chunk-tokens", "8", "--steps", "1", "--out", str(tmp_path / "r")]) == 2
    assert "--loss-chunk-tokens computes a Hugging Face causal LM's loss over chunks: give --model" in \
        capsys.readouterr().err
