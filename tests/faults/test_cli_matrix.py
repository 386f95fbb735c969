"""Acceptance: every command-line error of the fault matrix exits with the SPEC's status (2 for a bad
argument or config, 1 for a runtime failure) and prints one line naming the problem, never a
traceback. The rows' own tests check the behaviour behind each line."""

import fcntl
import json
import os
import shutil

import pytest

from outcore.tools.cli import main

QUICK = ["train", "--steps", "2", "--batch", "1", "--seq", "16", "--eval-batches", "1"]
NVME = ["--offload-params", "nvme", "--offload-optimizer", "nvme", "--nvme-dir", "nv"]


def _plant_symlink(tmp_path):
    (tmp_path / "nv").mkdir(mode=0o700)
    (tmp_path / "nv" / "rank0.swap").symlink_to(tmp_path / "victim")
    return [*QUICK, *NVME]


def _hold_lock(tmp_path):
    (tmp_path / "nv").mkdir(mode=0o700)
    fd = os.open(tmp_path / "nv" / "rank0.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: the run meets it as a second live run would
    os.write(fd, b"4242\n")
    return [*QUICK, *NVME]


def _hold_out(tmp_path):
    (tmp_path / "run").mkdir()
    fd = os.open(tmp_path / "run" / "run.rank0.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a live run on the same --out holds it
    os.write(fd, b"4343\n")
    return [*QUICK, "--out", "run"]


def _saved(tmp_path):
    assert main([*QUICK, "--out", "run"]) == 0
    return tmp_path / "run" / "checkpoints"


def _edit_meta(tmp_path):
    meta = _saved(tmp_path) / "step2" / "meta.json"
    data = json.loads(meta.read_text())
    data["step"] = 1
    meta.write_text(json.dumps(data))
    return [*QUICK, "--out", "run", "--steps", "3", "--resume"]


def _latest_elsewhere(tmp_path):
    (_saved(tmp_path) / "latest").write_text("/etc\n")
    return [*QUICK, "--out", "run", "--steps", "3", "--resume"]


def _missing_tag(tmp_path):
    _saved(tmp_path)
    return [*QUICK, "--out", "run", "--resume", "--tag", "nope"]


def _no_room(tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 16))
    return [*QUICK, *NVME]


def _seq2seq_model(tmp_path):
    import transformers

    cfg = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4)
    transformers.T5ForConditionalGeneration(cfg).save_pretrained(tmp_path / "t5")
    (tmp_path / "text.txt").write_text("some text to fine-tune on. " * 40)
    return [*QUICK, "--model", "t5", "--data", "text.txt"]


def _config(tmp_path, values):
    (tmp_path / "run.json").write_text(json.dumps(values))
    return [*QUICK, "--config", "run.json"]


CASES = [  # (id, argv or a function making it, exit status, words the one line holds)
    ("symlink in nvme_dir", _plant_symlink, 1, "is a symbolic link"),
    ("a live run holds nvme_dir", _hold_lock, 1, "in use by another live run (pid 4242"),
    ("a live run holds --out", _hold_out, 1, "run' is in use by another live run (pid 4343, rank 0)"),
    ("edited meta.json", _edit_meta, 1, "meta.json' is corrupt"),
    ("latest points elsewhere", _latest_elsewhere, 1, "not a bare tag name"),
    ("disk too small", _no_room, 1, "is full"),
    ("diverging loss", [*QUICK, "--lr", "1e30", "--lr-scheduler", "constant", "--grad-clip", "0", "--dtype", "fp32"],
     1, "training diverged"),
    ("--out is a file", lambda p: (p / "f").write_text("") or [*QUICK, "--out", "f"], 2, "is a file"),
    ("--resume without a checkpoint", [*QUICK, "--resume"], 2,
     "checkpoints' yet; run without --resume first, or point --out at the earlier run."),
    ("--tag without --resume", [*QUICK, "--tag", "step2"], 2, "give --resume too"),
    ("--resume --tag missing", _missing_tag, 2, "nope' does not exist; the tags there are ['step2']"),
    ("--model not a causal LM", _seq2seq_model, 2, "'t5' model (T5Config), which transformers builds no causal"),
    ("config of the wrong kind", lambda p: _config(p, {"stage": True}), 2, "stage=True: must be a whole number"),
    ("config key unknown", lambda p: _config(p, {"prefetch": 2}), 2, "unknown key(s) ['prefetch']"),
    ("config value out of range", lambda p: _config(p, {"grad_clip": -1}), 2, "grad_clip=-1.0"),
    ("--steps 0", [*QUICK, "--steps", "0"], 2, "is not a whole number of at least 1"),
    ("--timeout nan", [*QUICK, "--timeout", "nan"], 2, "is not a finite number above 0"),
    ("--device-budget not a size", [*QUICK, "--device-budget", "lots"], 2, "'lots' is not a size; write e.g."),
    ("--params not a count", ["estimate", "--params", "many"], 2, "'many' is not a count; write e.g. 125M"),
    ("--sub-group-size too small", ["estimate", "--params", "1B", "--sub-group-size", "8"], 2, "at least 1024"),
    ("export to a .bin", ["export", "ckpt", "model.bin"], 2, "outcore writes safetensors"),
    ("tune --out is a directory", lambda p: (p / "d").mkdir() or ["tune", "--config", "c.json", "--out", "d"], 2,
     "is a directory; name a file"),
    ("bench-disk --dir is a file", lambda p: (p / "f").write_text("") or ["bench-disk", "--dir", "f"], 2,
     "is a file; name a directory"),
]


@pytest.mark.parametrize("make, code, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_cli_error_is_one_line_with_the_spec_exit_status(tmp_path, monkeypatch, capsys, make, code, words):
    monkeypatch.chdir(tmp_path)
    if callable(make):
        argv = make(tmp_path, monkeypatch) if make is _no_room else make(tmp_path)
    else:
        argv = make
    capsys.readouterr()
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own exit for a malformed flag
        status = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == code, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("outcore") and words in lines[0], err
    assert not (tmp_path / "victim").exists()


@pytest.mark.slow  # spawns a process
def test_a_reader_that_leaves_early_stops_the_command_quietly(tmp_path):
    """`outcore estimate ... | head`: the pipe closes before the command prints; it stops with status 1
    and says nothing (it printed "failed: BrokenPipeError", and Python's exit then complained again)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "outcore.tools.cli", "estimate", "--params", "13B"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # long before the interpreter has started and computed the table
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert err == ""
