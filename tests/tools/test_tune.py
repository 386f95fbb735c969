"""`outcore tune`: measures candidates in their own processes and writes a config that trains."""

import dataclasses
import json
import math
import os
import sys

import pytest

import outcore
from outcore.tools.cli import main
from outcore.tools.train import TrainOptions, train
from outcore.tools.tune import tune

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from hf_models import VOCAB, save_model  # noqa: E402


def test_tune_writes_the_fastest_config_which_loads_and_trains(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    base = outcore.Config(offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"),
                          host_budget=32 << 20, grad_clip=None)
    base.to_file(tmp_path / "base.json")
    argv = ["tune", "--config", "base.json", "--model", "tiny", "--steps", "1", "--batch", "2", "--seq", "64",
            "--prefetch-depth", "1,2", "--block-size", "256K", "--queue-depth", "8", "--threads", "2",
            "--nice", "0,15", "--out", "tuned.json", "--json", "tune.json"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "tune.json").read_text())
    cands = report["candidates"]
    # as given, prefetch 1, the I/O pair, threads, nice 0 (15 is the default), and two host budgets
    # (the full one is the base again)
    assert len(cands) == 7 and all("step_seconds" in c for c in cands), cands
    assert {c["config"]["prefetch_depth"] for c in cands} == {1, 2}
    assert {c["config"]["io"]["nice"] for c in cands} == {0, 15}
    assert any(c["config"]["host_budget"] == 8 << 20 for c in cands)
    assert all(c["peak_rss_bytes"] > 100 << 20 for c in cands)  # measured in a real process
    written = json.loads((tmp_path / "tuned.json").read_text())
    assert written == report["best"]
    # The written config is a candidate measured fastest: within 2% of the quickest step (noise),
    # and of those the one with the least memory.
    chosen = [c for c in cands if c["config"] == written]
    assert len(chosen) == 1, "the written config was not among the measured candidates"
    quickest = min(c["step_seconds"] for c in cands)
    near = [c for c in cands if c["step_seconds"] <= 1.02 * quickest]
    assert chosen[0] in near
    assert chosen[0]["peak_rss_bytes"] == min(c["peak_rss_bytes"] for c in near)
    loaded = outcore.Config.from_file(tmp_path / "tuned.json")
    assert loaded.to_dict() == written  # every key written is one the runtime reads, unchanged
    assert "fastest (*) written to tuned.json" in printed
    s = train(TrainOptions(config="tuned.json", steps=3, batch=2, seq=64, save_final=False), report=lambda _: None)
    assert s["config"] == written and len(s["losses"]) == 3


def test_a_config_that_cannot_run_is_reported_not_tuned(tmp_path, capsys):
    base = outcore.Config(offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "n"),
                          host_budget=4096)  # far below the optimizer's working set
    with pytest.raises(ValueError, match="the config as given does not run: ValueError: host_budget=4,096"):
        tune(dataclasses.replace(base), "tiny", steps=1, sweep={"prefetch_depth": [1]})
    base.to_file(tmp_path / "small.json")
    argv = ["tune", "--config", str(tmp_path / "small.json"), "--steps", "1", "--out", str(tmp_path / "t.json")]
    assert main(argv) == 2  # the config's fault: a usage error, in one line
    err = capsys.readouterr().err.strip()
    assert "host_budget=4,096" in err and "\n" not in err and not (tmp_path / "t.json").exists()


def test_a_hugging_face_directory_is_tuned_with_its_own_weights_and_vocabulary(tmp_path):
    directory = save_model("llama", str(tmp_path / "llama"))  # no init of its own: it runs only from its weights
    base = outcore.Config(offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"),
                          grad_clip=None)
    same = {"prefetch_depth": [2], "block_size": [base.io.block_size], "queue_depth": [base.io.queue_depth],
            "threads": [base.io.threads], "nice": [base.io.nice]}
    best, tried = tune(base, directory, steps=1, batch=2, sweep=same)
    assert len(tried) == 1 and tried[0].ok, tried[0].result
    assert best.to_dict() == base.to_dict()
    assert abs(tried[0].result["loss"] - math.log(VOCAB)) < 0.5  # token ids below its vocabulary of 96
    assert tried[0].result["bytes_read_per_step"] > 0


CONFIG_TEXT = {"json": '{"offload_params": "nvme", "offload_optimizer": "nvme", "grad_clip": 0}',
               "toml": 'offload_params = "nvme"\noffload_optimizer = "nvme"\ngrad_clip = 0\n',
               "yml": "offload_params: nvme\noffload_optimizer: nvme\ngrad_clip: 0\n"}


@pytest.mark.parametrize("ext", sorted(CONFIG_TEXT))
def test_a_config_without_nvme_dir_is_tuned_in_a_scratch_folder_and_written_without_one(tmp_path, monkeypatch,
                                                                                          capsys, ext):
    """In the format it was given (a tuned.toml held JSON before, which `train --config` refused)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"run.{ext}").write_text(CONFIG_TEXT[ext])
    one = ["--prefetch-depth", "2", "--block-size", "1M", "--queue-depth", "32", "--threads", "4", "--nice", "15"]
    assert main(["tune", "--config", f"run.{ext}", "--steps", "1", "--seq", "32", *one, "--out", f"tuned.{ext}",
                 "--json", "tune.json"]) == 0
    assert "NVMe tier in" in capsys.readouterr().out
    written = outcore.Config.file_values(tmp_path / f"tuned.{ext}")  # parsed as its suffix says
    (candidate,) = json.loads((tmp_path / "tune.json").read_text())["candidates"]
    assert written.get("nvme_dir") is None and candidate["config"]["nvme_dir"] is not None
    assert written["grad_clip"] in (None, 0)  # TOML has no null: 0 is no clipping
    assert candidate["bytes_read_per_step"] > 0  # it ran on NVMe, in the scratch folder
    assert sorted(os.listdir(tmp_path)) == sorted([f"run.{ext}", "tune.json", f"tuned.{ext}"])  # and that is gone
    s = train(TrainOptions(config=f"tuned.{ext}", steps=2, batch=2, seq=32, save_final=False),
              report=lambda _: None)
    assert s["offload_params"] == "nvme" and s["config"]["grad_clip"] is None and len(s["losses"]) == 2


def test_an_out_it_could_not_read_back_is_refused_before_the_sweep(tmp_path, capsys):
    (tmp_path / "run.json").write_text("{}")
    assert main(["tune", "--config", str(tmp_path / "run.json"), "--out", str(tmp_path / "tuned.txt")]) == 2
    assert "--out: config" in capsys.readouterr().err and os.listdir(tmp_path) == ["run.json"]
