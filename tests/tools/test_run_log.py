"""A run you can watch: OUT/log.jsonl always, a row per --log-every steps and per evaluation, flushed
as written; a line per row where the output is a pipe; TensorBoard event files its reader loads."""

import json

import pytest

from outcore.tools.cli import main

TINY = ["train", "--batch", "1", "--seq", "16", "--steps", "6", "--eval-batches", "1", "--offload-params", "nvme",
        "--offload-optimizer", "nvme"]
FIELDS = {"step", "loss", "lr", "grad_norm", "tokens_per_second", "tokens", "io_wait_seconds", "bytes"}


def test_log_jsonl_has_a_row_per_log_every_steps_and_per_evaluation(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--out", str(out), "--log-every", "2", "--eval-every", "3"]) == 0
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3, 4, 6]
    assert all(FIELDS <= set(r) for r in rows) and set(rows[0]["bytes"]) == {"device", "host", "nvme"}
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6]
    assert rows[-1]["tokens"] == 6 * 16 and all(r["loss"] > 0 and r["lr"] > 0 for r in rows)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in printed] == ["2/6", "3/6", "4/6", "6/6"]  # captured: not a terminal


def test_report_to_tensorboard_writes_event_files_its_reader_loads(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert main([*TINY, "--out", str(out), "--log-every", "1", "--eval-every", "3", "--report-to", "tensorboard"]) == 0
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in events.Scalars("eval/loss")] == [3, 6]
    assert "train/lr" in events.Tags()["scalars"]


def test_an_unknown_tracker_is_refused_in_one_line(tmp_path, capsys):
    assert main([*TINY, "--out", str(tmp_path / "run"), "--report-to", "mlflow"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--report-to mlflow" in err[0]


@pytest.mark.slow
def test_report_to_wandb_logs_offline_without_a_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is outcore's default, not the environment's
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    assert main([*TINY, "--out", str(out), "--log-every", "2", "--eval-every", "3", "--report-to", "wandb"]) == 0
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    recorded = runs[0].read_bytes()  # the run's records, to sync later: each logged name is in them
    assert all(name in recorded for name in (b"loss", b"eval_loss", b"tokens_per_second", b"grad_norm"))
