"""examples/sft_trainer.py runs as a user runs it: a local tiny model, a JSONL file of conversations."""

import json
import os
import subprocess
import sys

import pytest
from trainer_setup import conversations, model_dir

pytest.importorskip("trl")
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "sft_trainer.py")


@pytest.mark.slow
def test_the_sft_example_trains_and_saves_adapters_peft_loads(tmp_path):
    import peft
    import transformers

    model = model_dir(str(tmp_path / "model"))
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in conversations(12)))
    cmd = [sys.executable, EXAMPLE, "--model", model, "--data", str(data), "--out", str(tmp_path / "run"),
           "--nvme-dir", str(tmp_path / "nvme"), "--steps", "4", "--lora", "4"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "'loss'" in res.stdout + res.stderr
    state = json.load(open(tmp_path / "run" / "checkpoint-4" / "trainer_state.json"))
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3, 4]
    base = transformers.AutoModelForCausalLM.from_pretrained(model)
    tuned = peft.PeftModel.from_pretrained(base, str(tmp_path / "run"))
    assert sum(p.numel() for n, p in tuned.named_parameters() if "lora_" in n) > 0
