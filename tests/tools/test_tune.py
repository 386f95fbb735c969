"""`outcore tune`: measures candidates in their own processes and writes a config that trains."""

import dataclasses
import json
import math
import os
import sys

import pytest

import outcore
from outcore.tools import tune as tune_module
from outcore.tools.cli import main
from outcore.tools.train import TrainOptions, train
from outcore.tools.tune import tune

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from hf_models import VOCAB, save_model  # noqa: E402


@pytest.mark.slow
def test_tune_measures_candidates_in_processes_and_writes_a_winner_only_where_it_holds(tmp_path, monkeypatch,
                                                                                      capsys):
    monkeypatch.chdir(tmp_path)
    base = outcore.Config(offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"),
                          host_budget=32 << 20, grad_clip=None)
    base.to_file(tmp_path / "base.json")
    argv = ["tune", "--config", "base.json", "--model", "tiny", "--steps", "1", "--batch", "2", "--seq", "64",
            "--prefetch-depth", "1,2", "--block-size", "1M", "--queue-depth", "32", "--threads", "4",
            "--nice", "15", "--rounds", "1", "--no-prune", "--out", "tuned.json", "--json", "tune.json"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "tune.json").read_text())
    cands = report["candidates"]
    # as given, prefetch 1, and two host budgets (the full one is the base again); the I/O knobs at
    # their defaults have no other value here (their variants: the stubbed sweeps of test_sweep_pruning)
    assert len(cands) == 4 and all("step_seconds" in c for c in cands), cands
    assert {c["config"]["prefetch_depth"] for c in cands} == {1, 2}
    assert any(c["config"]["host_budget"] == 8 << 20 for c in cands)
    assert all(c["peak_rss_bytes"] > 100 << 20 for c in cands)  # measured in a real process
    confirmation = report["confirmation"]
    if report["best"] is None:  # the given config won, or its winner did not hold: nothing written
        assert confirmation is None or not confirmation["holds"]
        assert "no config written" in printed and not (tmp_path / "tuned.json").exists()
        return
    assert confirmation["holds"] and confirmation["ratio"] < 1 - confirmation["spread"]
    written = json.loads((tmp_path / "tuned.json").read_text())
    assert written == report["best"] and written in [c["config"] for c in cands]
    loaded = outcore.Config.from_file(tmp_path / "tuned.json")
    assert loaded.to_dict() == written  # every key written is one the runtime reads, unchanged
    assert "fastest (*) written to tuned.json" in printed
    s = train(TrainOptions(config="tuned.json", steps=3, batch=2, seq=64, save_final=False), report=lambda _: None)
    assert s["config"] == written and len(s["losses"]) == 3


def timed(seconds_of, calls):
    """A stand-in for `run_candidate`: the step time `seconds_of(prefetch_depth, nth call of it)`
    gives, each call recorded."""
    seen: dict[int, int] = {}

    def run(config, model_spec, **_):
        depth = config.prefetch_depth
        seen[depth] = seen.get(depth, 0) + 1
        calls.append(depth)
        return {"step_seconds": seconds_of(depth, seen[depth]), "io_wait_seconds": 0.0, "peak_rss_bytes": 1 << 30,
                "bytes_read_per_step": 0, "bytes_written_per_step": 0, "loss": 1.0}

    return run


PREFETCH_ONLY = {"prefetch_depth": [1, 4]}  # nothing on NVMe: the only phase


def test_candidates_run_interleaved_and_the_winner_is_confirmed_against_the_given_config(monkeypatch):
    calls = []
    monkeypatch.setattr(tune_module, "run_candidate", timed(lambda d, n: {2: 1.0, 1: 0.8, 4: 0.95}[d], calls))
    tuned = tune(outcore.Config(), "tiny", sweep=PREFETCH_ONLY, rounds=3)
    # the given config once, then three rounds of the phase, each led by another candidate, then
    # three rounds of the winner against the given config
    assert calls == [2, 2, 1, 4, 1, 4, 2, 4, 2, 1, 2, 1, 1, 2, 2, 1]
    assert tuned.best is not None and tuned.best.prefetch_depth == 1
    assert tuned.confirmation.ratio == pytest.approx(0.8) and tuned.confirmation.holds


def test_a_candidate_fast_in_one_round_only_does_not_win(monkeypatch):
    calls = []
    monkeypatch.setattr(tune_module, "run_candidate",
                        timed(lambda d, n: 0.5 if (d, n) == (1, 1) else {2: 1.0, 1: 1.05, 4: 1.1}[d], calls))
    tuned = tune(outcore.Config(), "tiny", sweep=PREFETCH_ONLY, rounds=3)
    assert tuned.best is None and tuned.confirmation is None  # the given config won the sweep
    assert len(calls) == 1 + 3 * 3


def test_a_candidate_that_fails_drops_out_and_the_sweep_goes_on(monkeypatch):
    calls = []
    run = timed(lambda d, n: {2: 1.0, 1: 0.8}[d], calls)

    def failing(config, model_spec, **kw):
        if config.prefetch_depth == 4:  # refused, as a host budget below the working set is
            calls.append(4)
            return {"error": "ValueError: host_budget too small", "refused": True}
        return run(config, model_spec, **kw)

    monkeypatch.setattr(tune_module, "run_candidate", failing)
    tuned = tune(outcore.Config(), "tiny", sweep=PREFETCH_ONLY, rounds=3)
    assert calls.count(4) == 1  # tried once, then left out of the later rounds
    assert tuned.best is not None and tuned.best.prefetch_depth == 1
    failed = [c for c in tuned.candidates if not c.ok]
    assert [c.config.prefetch_depth for c in failed] == [4] and "host_budget" in failed[0].result["error"]


def test_a_winner_within_the_given_configs_spread_is_not_written(tmp_path, monkeypatch, capsys):
    # in the sweep prefetch 1 is 5% faster; in the confirmation the given config swings by 20%
    swings = {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 0.9, 6: 1.1, 7: 1.0}  # its 5th to 7th runs: the confirmation
    calls = []
    monkeypatch.setattr(tune_module, "run_candidate",
                        timed(lambda d, n: swings[n] if d == 2 else {1: 0.95, 4: 1.2}[d], calls))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.json").write_text('{"grad_clip": null}')
    argv = ["tune", "--config", "run.json", "--prefetch-depth", "1,4", "--out", "tuned.json", "--json", "t.json"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "measuring this machine's rates to predict which candidates can matter" in printed
    assert "nothing beat the config as given beyond its own spread: no config written" in printed
    assert "0.950x, the given config's own spread 20.0%" in printed
    assert not (tmp_path / "tuned.json").exists()
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["best"] is None and report["confirmation"]["holds"] is False
    assert report["confirmation"]["given_s"] == [0.9, 1.1, 1.0]


@pytest.mark.slow
def test_a_config_that_cannot_run_is_reported_not_tuned(tmp_path, capsys):
    base = outcore.Config(offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "n"),
                          host_budget=4096)  # far below the optimizer's working set
    with pytest.raises(ValueError, match="the config as given does not run: ValueError: host_budget=4,096"):
        tune(dataclasses.replace(base), "tiny", steps=1, sweep={"prefetch_depth": [1]})
    base.to_file(tmp_path / "small.json")
    argv = ["tune", "--config", str(tmp_path / "small.json"), "--steps", "1", "--no-prune",
            "--out", str(tmp_path / "t.json")]
    assert main(argv) == 2  # the config's fault: a usage error, in one line
    err = capsys.readouterr().err.strip()
    assert "host_budget=4,096" in err and "\n" not in err and not (tmp_path / "t.json").exists()


@pytest.mark.slow
def test_a_hugging_face_directory_is_tuned_with_its_own_weights_and_vocabulary(tmp_path):
    directory = save_model("llama", str(tmp_path / "llama"))  # no init of its own: it runs only from its weights
    base = outcore.Config(offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"),
                          grad_clip=None)
    same = {"prefetch_depth": [2], "block_size": [base.io.block_size], "queue_depth": [base.io.queue_depth],
            "threads": [base.io.threads], "nice": [base.io.nice]}
    tuned = tune(base, directory, steps=1, batch=2, sweep=same)
    tried = tuned.candidates
    assert len(tried) == 1 and tried[0].ok, tried[0].result
    assert tuned.best is None  # nothing but the given config: nothing to write
    assert abs(tried[0].result["loss"] - math.log(VOCAB)) < 0.5  # token ids below its vocabulary of 96
    assert tried[0].result["bytes_read_per_step"] > 0


CONFIG_TEXT = {"json": '{"offload_params": "nvme", "offload_optimizer": "nvme", "grad_clip": 0}',
               "toml": 'offload_params = "nvme"\noffload_optimizer = "nvme"\ngrad_clip = 0\n',
               "yml": "offload_params: nvme\noffload_optimizer: nvme\ngrad_clip: 0\n"}


@pytest.mark.slow
@pytest.mark.parametrize("ext", sorted(CONFIG_TEXT))
def test_a_config_without_nvme_dir_is_tuned_in_a_scratch_folder_and_written_without_one(tmp_path, monkeypatch,
                                                                                          capsys, ext):
    """In the format it was given (a tuned.toml held JSON before, which `train --config` refused)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"run.{ext}").write_text(CONFIG_TEXT[ext])
    # prefetch 1 wins whatever it measures: what is written, and where, is under test here; one real
    # run (the given config's, in the scratch folder) stands for every measurement
    real, first = tune_module.run_candidate, []

    def once(config, model_spec, **kw):
        first or first.append(real(config, model_spec, **kw))
        return dict(first[0])

    monkeypatch.setattr(tune_module, "run_candidate", once)
    monkeypatch.setattr(tune_module, "_better", lambda a, b: True)
    monkeypatch.setattr(tune_module.Confirmation, "holds", property(lambda self: True))
    one = ["--prefetch-depth", "1", "--block-size", "1M", "--queue-depth", "32", "--threads", "4", "--nice", "15"]
    assert main(["tune", "--config", f"run.{ext}", "--steps", "1", "--seq", "32", *one, "--rounds", "1",
                 "--no-prune", "--out", f"tuned.{ext}", "--json", "tune.json"]) == 0
    assert "NVMe tier in" in capsys.readouterr().out
    written = outcore.Config.file_values(tmp_path / f"tuned.{ext}")  # parsed as its suffix says
    assert written["prefetch_depth"] == 1
    candidate = json.loads((tmp_path / "tune.json").read_text())["candidates"][-1]
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
