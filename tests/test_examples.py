"""Every script under examples/ runs as a user runs it, offline on a CPU, on the tiny model it builds
itself (examples/tiny_model.py), and does what its docstring says."""

import json
import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def run(tmp_path, name: str, *args: str) -> str:
    res = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def test_every_example_is_run_here():
    scripts = {n for n in os.listdir(EXAMPLES) if n.endswith(".py") and n != "tiny_model.py"}
    assert scripts == {"sft_trainer.py", "qlora_sft_trainer.py", "dpo_trainer.py", "grpo_trainer.py",
                       "train_resume_mix.py", "estimate_then_train.py"}  # sft_trainer.py: tests/hf/test_example.py


@pytest.mark.slow
def test_qlora_sft_trains_and_its_checkpoint_exports_merged(tmp_path):
    pytest.importorskip("bitsandbytes")
    out = run(tmp_path, "qlora_sft_trainer.py")
    assert "merged: outcore export qlora-run/checkpoint-6/outcore merged/ --merge-adapters" in out
    assert os.path.exists(tmp_path / "qlora-run" / "adapter_model.safetensors")
    res = subprocess.run([sys.executable, "-m", "outcore.tools.cli", "export", "qlora-run/checkpoint-6/outcore",
                          "merged", "--merge-adapters"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert os.path.exists(tmp_path / "merged" / "model.safetensors")


@pytest.mark.slow
def test_dpo_moves_the_reward_margin(tmp_path):
    out = run(tmp_path, "dpo_trainer.py")
    first, last = (float(x) for x in out.split("reward margin ")[1].split(";")[0].split(" -> "))
    assert last > first


@pytest.mark.slow
def test_grpo_generates_and_rewards(tmp_path):
    out = run(tmp_path, "grpo_trainer.py")
    assert out.count("mean reward by step: ") == 1 and os.path.exists(tmp_path / "grpo-run" / "adapter_config.json")


@pytest.mark.slow
def test_train_mixes_then_resumes_by_its_run_directory(tmp_path):
    out = run(tmp_path, "train_resume_mix.py")
    assert "$ outcore train --out mix-run/run --resume --steps 8" in out
    assert "resumed from mix-run/run/checkpoints/step4 at step 4" in out
    rows = [json.loads(line) for line in open(tmp_path / "mix-run" / "run" / "log.jsonl")]
    assert rows[-1]["step"] == 8


@pytest.mark.slow
def test_estimate_then_train_with_its_flags(tmp_path):
    out = run(tmp_path, "estimate_then_train.py")
    verdict = json.load(open(tmp_path / "estimated-run" / "estimate.json"))["verdict"]
    assert verdict["fits"] and verdict["flags"] in out and "outcore train: done." in out
