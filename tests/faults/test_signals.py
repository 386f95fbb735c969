"""Row 7: SIGTERM and Ctrl-C stop `outcore train` at a step boundary with exit 143 or 130 and one
line, the scratch folder removed and the last checkpoint whole; a run killed with SIGKILL leaves its
scratch folders behind, and the next run reclaims them."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

TRAIN = [sys.executable, "-m", "outcore.tools.cli", "train", "--batch", "1", "--seq", "16", "--eval-every", "1",
         "--eval-batches", "1", "--save-every", "5"]
NVME = ["--offload-params", "nvme", "--offload-optimizer", "nvme"]  # train makes .outcore-nvme-* in the cwd
HOST = ["--offload-params", "cpu", "--offload-optimizer", "cpu"]  # the engine makes outcore-* in TMPDIR


def _start(tmp_path, *extra, steps=100000):
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*TRAIN, "--steps", str(steps), *extra], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_step(proc, step: int) -> None:
    for line in proc.stdout:
        if line.startswith(f"step {step}/"):
            return
    raise AssertionError(f"the run ended before step {step}: {proc.stderr.read()[-2000:]}")


def _scratch(tmp_path) -> list[str]:
    return sorted(n for n in os.listdir(tmp_path) if n.startswith((".outcore-nvme-", "outcore-")) and
                  n != "outcore-run")


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
def test_a_signal_stops_cleanly(tmp_path, signum, code, twice):
    proc = _start(tmp_path, *NVME, "--json", str(tmp_path / "summary.json"))
    try:
        _wait_for_step(proc, 7)
        assert len(_scratch(tmp_path)) == 1
        proc.send_signal(signum)
        if twice:  # a second signal stops mid-step
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"outcore train: stopped by {signal.Signals(signum).name}")
    assert _scratch(tmp_path) == []
    ckpts = tmp_path / "outcore-run" / "checkpoints"
    tag = (ckpts / "latest").read_text().strip()
    meta = json.loads((ckpts / tag / "meta.json").read_text())
    assert meta["step"] >= 5 and not [n for n in os.listdir(ckpts) if n.endswith(".tmp")]
    if not twice:  # stopped at a step boundary: that step is saved and summarized, and the line says where
        assert "after step" in lines[0] and "--resume" in lines[0] and f"outcore-run/checkpoints/{tag}" in lines[0]
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["stopped"]["after_step"] == meta["step"] == len(summary["losses"])
        assert summary["stopped"]["signal"] == signal.Signals(signum).name


@pytest.mark.slow
def test_a_run_stopped_by_ctrl_c_and_resumed_ends_as_the_uninterrupted_run(tmp_path):
    """SIGINT mid-run saves the step it stopped after (no --save-every needed); --resume continues with
    the same batches and ends with the weights of a run that was never stopped."""
    from safetensors.torch import load_file

    steps = ["--steps", "12", "--save-every", "100"]
    whole = subprocess.run([*TRAIN, *NVME, *steps, "--out", str(tmp_path / "whole")], cwd=tmp_path,
                           capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert whole.returncode == 0, whole.stderr
    proc = _start(tmp_path, *NVME, "--out", str(tmp_path / "cut"), steps=12)
    try:
        _wait_for_step(proc, 4)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    again = subprocess.run([*TRAIN, *NVME, *steps, "--out", str(tmp_path / "cut"), "--resume"], cwd=tmp_path,
                           capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert again.returncode == 0, again.stderr
    exported = {}
    for run in ("whole", "cut"):
        out = str(tmp_path / f"{run}.safetensors")
        res = subprocess.run([sys.executable, "-m", "outcore.tools.cli", "export", str(tmp_path / run / "checkpoints"),
                              out, "--dtype", "fp32"], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        exported[run] = load_file(out)
    assert exported["whole"].keys() == exported["cut"].keys()
    for k, v in exported["whole"].items():
        assert torch.equal(exported["cut"][k], v), k


@pytest.mark.slow
@pytest.mark.parametrize("offload", [NVME, HOST], ids=["nvme", "host"])
def test_a_killed_run_is_reclaimed_by_the_next(tmp_path, offload):
    proc = _start(tmp_path, *offload)
    try:
        _wait_for_step(proc, 3)
    finally:
        proc.kill()
        proc.wait()
    left = _scratch(tmp_path)
    assert len(left) == 1 and os.listdir(tmp_path / left[0])
    alive = _start(tmp_path, *offload, "--out", "second")
    try:
        _wait_for_step(alive, 2)
        live = _scratch(tmp_path)
        assert len(live) == 1 and live != left  # the dead run's folder went at this start
        short = _start(tmp_path, *offload, "--out", "third", steps=2)
        _, err = short.communicate(timeout=120)
        assert short.returncode == 0, err
        assert _scratch(tmp_path) == live  # a live run's folder is left alone
    finally:
        alive.kill()
        alive.wait()
    assert alive.stderr.read().count("left by a run that died") == 1
