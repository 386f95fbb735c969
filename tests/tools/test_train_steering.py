"""`outcore train` as a fine-tuner steers it: resume from OUT/run.json with `--out OUT --resume` alone,
transformers' schedule flags, epochs, several --data files mixed, the LoRA rank refusal, and a line
at least every minute with the time left."""

import json
import os
import re
import sys

import pytest

from outcore.tools import cli, progress_lines
from outcore.tools.cli import main
from outcore.tools.lr_schedules import Schedule

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from hf_models import STORY, save_model, save_tokenizer  # noqa: E402

TINY = ["train", "--batch", "2", "--seq", "16", "--dtype", "fp32", "--eval-every", "100", "--eval-batches", "1",
        "--offload-params", "cpu", "--offload-optimizer", "cpu"]


def rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_resume_by_out_alone_goes_on_with_the_run_s_arguments(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = [*TINY, "--steps", "6", "--lr-scheduler", "linear", "--warmup-steps", "1", "--weight-decay", "0.01",
           "--adam-beta2", "0.99", "--save-every", "3", "--log-every", "1"]
    assert main([*run, "--out", "whole", "--json", "whole.json"]) == 0
    real_print = print

    def dies_at_step_5(*args, **kwargs):
        if args and str(args[0]).startswith("step 5/6"):
            raise KeyboardInterrupt  # killed during step 5: its last checkpoint is step 3
        real_print(*args, **kwargs)

    monkeypatch.setattr(cli, "print", dies_at_step_5, raising=False)
    with pytest.raises(KeyboardInterrupt):
        main([*run, "--out", "split"])
    monkeypatch.delattr(cli, "print")
    assert json.load(open("split/run.json"))["lr_scheduler"] == "linear"
    from outcore.tools.train import _kept  # what a run stopped by a signal says last

    assert _kept("split/checkpoints", "split").endswith("go on with: outcore train --out split --resume")
    capsys.readouterr()

    assert main(["train", "--out", "split", "--preset", "gpt-125m", "--resume"]) == 2  # another model
    said = capsys.readouterr().err
    assert "--preset gpt-125m differs from the run's unset" in said and "\n" not in said.strip()
    assert main(["train", "--out", "split", "--resume", "--seq", "32"]) == 2
    assert "--seq 32 differs from the run's 16" in capsys.readouterr().err

    assert main(["train", "--out", "split", "--resume", "--json", "resumed.json"]) == 0
    whole, resumed = json.load(open("whole.json")), json.load(open("resumed.json"))
    assert resumed["start_step"] == 3 and resumed["losses"] == whole["losses"][3:]  # bit for bit
    assert resumed["optimizer"] == whole["optimizer"]  # betas and weight decay from run.json

    assert main(["train", "--out", "split", "--resume", "--steps", "7", "--log-every", "5"]) == 0
    out = capsys.readouterr().out
    assert "resumed with --steps 7 (the run had 6)" in out and "resumed with --log-every 5 (the run had 1)" in out
    assert json.load(open("split/run.json"))["steps"] == 7  # the next resume goes on from here


@pytest.mark.parametrize("flags, name, warmup", [
    (["--lr-scheduler", "constant_with_warmup", "--warmup-steps", "2"], "constant_with_warmup", 2),
    (["--lr-scheduler", "cosine", "--warmup-ratio", "0.25"], "cosine", 2),
    ([], "cosine_with_min_lr", 0),  # outcore's default: a tenth of the run, none below 10 steps
])
def test_the_schedule_flags_set_the_rate_of_each_step(tmp_path, monkeypatch, flags, name, warmup):
    monkeypatch.chdir(tmp_path)
    assert main([*TINY, "--steps", "6", "--lr", "0.01", "--log-every", "1", "--no-save", *flags]) == 0
    logged = [r["lr"] for r in rows("outcore-run/log.jsonl")]
    schedule = Schedule(name, 6, warmup, 0.01)
    assert logged == pytest.approx([schedule.rate(s) for s in range(6)], rel=1e-12, abs=1e-15)


def test_epochs_set_the_steps_and_steps_cap_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "t.txt"
    text.write_text("abcdefgh" * 200)  # 1,600 bytes: 1,520 to train on, 95 windows of 16
    assert main([*TINY, "--data", str(text), "--epochs", "0.1", "--no-save", "--json", "a.json"]) == 0
    assert json.load(open("a.json"))["steps"] == 5  # ceil(0.1 x 95 / 2)
    assert main([*TINY, "--data", str(text), "--epochs", "2", "--steps", "3", "--no-save", "--json", "b.json"]) == 0
    assert json.load(open("b.json"))["steps"] == 3


def test_a_line_comes_at_least_every_minute_with_the_time_left(tmp_path, monkeypatch, capsys):
    """Steps that take over 60 s (a stub clock) are each said, whatever --log-every says."""
    monkeypatch.chdir(tmp_path)
    now = [0.0]

    def clock() -> float:
        now[0] += 61.0
        return now[0]

    monkeypatch.setattr(progress_lines, "monotonic", clock)
    assert main([*TINY, "--steps", "4", "--log-every", "100", "--no-save"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/4", "2/4", "3/4", "4/4"]
    assert all(" ETA " in line for line in lines) and " ETA 0s" in lines[-1]
    assert len(rows("outcore-run/log.jsonl")) == 1  # the log's rows keep --log-every (and the last step)


@pytest.fixture
def model_dir(tmp_path):
    directory = save_model("llama", str(tmp_path / "llama"))
    save_tokenizer(directory)
    return directory


def test_several_data_files_are_said_each_and_mixed(tmp_path, model_dir, capsys):
    pytest.importorskip("peft")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"text": STORY}) + "\n" for _ in range(30)))
    words = STORY.split()
    b.write_text("".join(json.dumps({"prompt": " ".join(words[:5]), "completion": " " + " ".join(words[5:9])}) + "\n"
                         for _ in range(10)))
    base = ["train", "--model", model_dir, "--seq", "16", "--batch", "2", "--steps", "1", "--dtype", "fp32",
            "--eval-batches", "1", "--no-save", "--out", str(tmp_path / "run"), "--lora", "2"]
    assert main([*base, "--data", str(a), "--data", str(b)]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"data {re.escape(str(a))}: text rows, \d+ samples, \d+% of tokens carry the loss", out)
    assert re.search(rf"data {re.escape(str(b))}: prompt-completion rows, 9 samples, \d+% of tokens", out)  # 1 held out
    assert main([*base, "--data", f"{a}:3", "--data", f"{b}:1"]) == 0
    out = capsys.readouterr().out
    drawn = [int(n) for n in re.findall(r"weight \d: (\d+) samples drawn", out)]
    assert len(drawn) == 2 and drawn[0] > drawn[1]


def test_a_lora_rank_above_a_layer_s_smaller_dimension_is_refused_naming_it(tmp_path, model_dir, capsys):
    pytest.importorskip("peft")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": STORY}) + "\n" for _ in range(10)))
    assert main(["train", "--model", model_dir, "--data", str(data), "--lora", "20", "--out",
                 str(tmp_path / "run")]) == 2
    said = capsys.readouterr().err
    assert "--lora 20: above the smaller dimension of model.layers.0.self_attn.k_proj (16 x 32)" in said
    assert not os.path.exists(tmp_path / "run")
