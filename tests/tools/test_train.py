"""`outcore train`: the main job, on the built-in corpus, with offload, resume and configs."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from launch import torchrun  # noqa: E402

from outcore.tools.cli import main
from outcore.tools.lr_schedules import DEFAULT, Schedule, default_warmup
from outcore.tools.train import TrainOptions, train


@pytest.mark.slow
def test_tiny_on_the_default_corpus_lowers_the_loss(tmp_path):
    out = tmp_path / "summary.json"
    res = subprocess.run([sys.executable, "-m", "outcore.tools.cli", "train", "--preset", "tiny", "--steps", "30",
                          "--json", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert res.returncode == 0, res.stderr[-2000:]
    s = json.loads(out.read_text())
    losses = s["losses"]
    assert len(losses) == 30 and losses[0] > 5.0  # about ln(256) at the start
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
    vals = [v for _, v in s["val_losses"]]
    assert len(vals) == 5 and vals[-1] < vals[0]
    last = res.stdout.strip().splitlines()[-1]
    assert "done" in last and "peak RSS" in last and "842K params" in last  # 842,496
    assert os.path.exists(tmp_path / "outcore-run" / "checkpoints" / "step30" / "meta.json")
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".outcore-nvme")]


@pytest.mark.slow
def test_resume_continues_exactly_with_states_on_nvme(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    common = dict(preset="tiny", offload_params="nvme", offload_optimizer="nvme", batch=4, eval_batches=1)
    whole = train(TrainOptions(steps=8, out="whole", eval_every=100, **common), report=lambda _: None)

    def crash_at_step_5(line: str) -> None:
        if line.startswith("step 5/8"):
            raise KeyboardInterrupt  # the run dies after step 5; its last checkpoint is step 4

    with pytest.raises(KeyboardInterrupt):
        train(TrainOptions(steps=8, out="split", save_every=4, eval_every=5, **common), report=crash_at_step_5)
    assert open("split/checkpoints/latest").read().strip() == "step4"
    assert not os.path.exists("split/run.rank0.lock")  # the dead run let go of --out: the resume may take it
    resumed = train(TrainOptions(steps=8, out="split", resume=True, eval_every=100, **common),
                    report=lambda _: None)
    assert resumed["start_step"] == 4
    again = train(TrainOptions(steps=8, out="split", resume=True, **common), report=lambda _: None)
    assert again["start_step"] == 8 and again["losses"] == []  # nothing left to do, and it says so
    said: list[str] = []
    fewer = train(TrainOptions(steps=6, out="split", resume=True, **common), report=said.append)
    assert fewer["losses"] == [] and "trained 0 steps (the checkpoint is at step 8, and --steps is 6)" in said[-1]
    assert resumed["losses"] == whole["losses"][4:]  # bit for bit: same data, same states
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".outcore-nvme")]  # scratch removed


def test_one_folder_may_be_both_out_and_nvme_dir(tmp_path, monkeypatch):
    """Each holds a lock of its own there (run.rank0.lock and rank0.lock), so the run does not meet itself."""
    monkeypatch.chdir(tmp_path)
    summary = train(TrainOptions(preset="tiny", steps=2, batch=1, seq=16, eval_batches=1, out="both", nvme_dir="both",
                                 offload_params="nvme", offload_optimizer="nvme"), report=lambda _: None)
    assert len(summary["losses"]) == 2 and os.path.isdir("both/checkpoints/step2")
    assert not [f for f in os.listdir("both") if f.endswith(".lock")]


def test_config_file_and_text_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "story.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 2000, encoding="utf-8")
    cfg = tmp_path / "run.yaml"
    cfg.write_text("offload_params: cpu\noffload_optimizer: cpu\ngrad_clip: null\nprefetch_depth: 1\n")
    s = train(TrainOptions(steps=12, config=str(cfg), data=(str(text),), batch=4, save_final=False,
                           checkpoint_activations=True), report=lambda _: None)
    assert s["offload_params"] == "cpu" and s["config"]["grad_clip"] is None and s["config"]["prefetch_depth"] == 1
    assert s["losses"][-1] < s["losses"][0] - 1.0  # a repetitive text is learned fast
    assert os.listdir(tmp_path / "outcore-run") == ["log.jsonl"]  # no checkpoint, no export: the log alone


def test_the_default_schedule_warms_up_then_decays_to_a_tenth():
    schedule = Schedule(DEFAULT, 200, default_warmup(200), 1e-3)
    lrs = [schedule.rate(s) for s in range(200)]
    assert lrs[0] == 0 and lrs[1] == pytest.approx(5e-5) and max(lrs) == pytest.approx(1e-3)
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01) and lrs.index(max(lrs)) == 20
    short = Schedule(DEFAULT, 3, default_warmup(3), 1e-3)
    assert default_warmup(3) == 0 and short.rate(0) == pytest.approx(1e-3)  # a short run is not all warm-up


@pytest.mark.parametrize(("argv", "message"), [
    (["--preset", "gpt-9t"], "gpt-9t"),
    (["--resume"], "no checkpoint"),
    (["--data", "missing.txt"], "missing.txt"),
    (["--preset", "tiny", "--model", "llama"], "each name the model to train: give one"),
    (["--offload-params", "nvme", "--stage-typo"], "unrecognized"),
])
def test_mistakes_exit_2_with_one_line(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["train", "--steps", "1", *argv])
    except SystemExit as e:  # argparse's own errors leave through SystemExit
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_out_that_cannot_be_a_directory_exits_2_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("kept")
    assert main(["train", "--steps", "1", "--out", "notes.txt"]) == 2
    assert "notes.txt' is a file; name a directory." in capsys.readouterr().err
    for out in ("notes.txt/run", "/proc/outcore-run"):  # /proc passes an access check, then refuses mkdir
        assert main(["train", "--steps", "1", "--out", out]) == 2
        assert f"{out}' cannot be " in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "kept" and os.listdir(tmp_path) == ["notes.txt"]


def test_accumulate_runs_train_batch_with_the_losses_of_grad_accumulation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "accum.json").write_text(json.dumps({"grad_accumulation": 4, "dtype": "fp32", "grad_clip": None,
                                                      "offload_params": "nvme", "offload_optimizer": "nvme"}))
    (tmp_path / "one.json").write_text(json.dumps({"dtype": "fp32", "grad_clip": None, "offload_params": "nvme",
                                                    "offload_optimizer": "nvme"}))
    common = dict(steps=3, batch=2, seq=32, eval_every=100, eval_batches=1, save_final=False)
    ref = train(TrainOptions(config="accum.json", **common), report=lambda _: None)
    ours = train(TrainOptions(config="one.json", accumulate=4, **common), report=lambda _: None)
    assert len(ours["losses"]) == 3
    for a, b in zip(ours["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    with pytest.raises(ValueError, match="grad_accumulation=4 must then be 1"):
        train(TrainOptions(config="accum.json", accumulate=2, **common), report=lambda _: None)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".outcore-nvme")]


def test_a_step_over_micro_batches_takes_their_mean_gradient(tmp_path, monkeypatch):
    """As DeepSpeed's engine and the Hugging Face Trainer do (the engine divides by K, the command
    line does not): K copies of one micro-batch make the step one copy makes, so clipping sees the
    same norm for any K, through backward() and through train_batch alike."""
    from outcore.tools import train_job

    monkeypatch.chdir(tmp_path)
    at = train_job.Data.at
    monkeypatch.setattr(train_job.Data, "at", lambda self, index, shard=(0, 1): at(self, 0, shard))
    common = dict(steps=2, batch=2, seq=32, eval_every=100, eval_batches=1, save_final=False)
    runs = {}
    for name, accumulate, config in (("one", None, {}), ("backward", None, {"grad_accumulation": 3}),
                                     ("train_batch", 3, {})):
        (tmp_path / f"{name}.json").write_text(json.dumps({"dtype": "fp32", "grad_clip": 0.5, **config}))
        runs[name] = train(TrainOptions(config=f"{name}.json", accumulate=accumulate, **common), report=lambda _: None)
    one = runs["one"]
    assert all(n is not None and n > 0.5 for n in one["grad_norms"])  # clipping at work
    for name in ("backward", "train_batch"):
        for ours, ref in ((runs[name]["grad_norms"], one["grad_norms"]), (runs[name]["losses"], one["losses"])):
            assert len(ours) == len(ref) == 2
            assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, ref, strict=True)), (name, ours, ref)


@pytest.mark.slow
def test_two_ranks_under_torchrun_train_on_their_own_rows_as_one_rank_on_both(tmp_path):
    """Each rank takes its rows of one global batch: 2 ranks of batch 2 train as 1 rank of batch 4
    (every rank had trained on the same rows before), rank 0 alone reports the mean loss, and their
    checkpoint resumes on one rank as if it had run throughout."""
    args = ["train", "--steps", "4", "--seq", "32", "--dtype", "fp32", "--offload-params", "nvme",
            "--offload-optimizer", "nvme", "--eval-every", "2", "--eval-batches", "2",
            "--warmup-steps", "10"]  # the rates of 4 steps and of 6 alike: all warm-up
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    two = subprocess.run([*torchrun(2, tmp_path), "-m", "outcore.tools.cli", *args, "--batch", "2", "--json",
                          "two.json", "--out", "two"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run([sys.executable, "-m", "outcore.tools.cli", *args, "--batch", "4", "--json", "one.json",
                          "--out", "one", "--steps", "6"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    # The two ranks' checkpoint resumes on one rank of the whole batch, as if one rank had run throughout.
    resumed = subprocess.run([sys.executable, "-m", "outcore.tools.cli", *args, "--batch", "4", "--json",
                              "resumed.json", "--out", "two", "--steps", "6", "--resume"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = json.loads((tmp_path / "two.json").read_text()), json.loads((tmp_path / "one.json").read_text())
    assert a["losses"] == pytest.approx(b["losses"][:4], rel=1e-5)
    assert [v for _, v in a["val_losses"]] == pytest.approx([v for _, v in b["val_losses"][:2]], rel=1e-5)
    after = json.loads((tmp_path / "resumed.json").read_text())
    assert after["start_step"] == 4 and after["losses"] == pytest.approx(b["losses"][4:], rel=1e-5)
    assert len([line for line in two.stdout.splitlines() if line.startswith("step 4/4")]) == 1


def test_the_json_summary_goes_into_folders_made_for_it(tmp_path, monkeypatch):
    """--json passed the up-front check for a folder that did not exist yet, then failed to write
    it once training was done."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--steps", "1", "--batch", "1", "--seq", "16", "--eval-batches", "1", "--no-save",
                 "--json", "reports/tiny/summary.json"]) == 0
    assert json.loads((tmp_path / "reports" / "tiny" / "summary.json").read_text())["steps"] == 1
