"""Round 4, item 10: `outcore train ... | head -1` must not lose the run. The reader leaves after the
first line; the run goes on to its last step, logs every row to OUT/log.jsonl, saves its checkpoint
and exits 0, saying once on stderr that stdout was closed."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_a_closed_stdout_does_not_stop_the_run(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "outcore.tools.cli", "train", "--steps", "4", "--log-every", "1", "--batch", "2",
           "--seq", "16", "--offload-params", "cpu", "--offload-optimizer", "cpu", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"outcore train:")
    proc.stdout.close()  # as `head -1` does after its line
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()
    assert err.decode().count("stdout was closed; the run goes on") == 1
    assert [json.loads(line)["step"] for line in open(out / "log.jsonl")] == [1, 2, 3, 4]
    assert os.path.isdir(out / "checkpoints" / "step4")
