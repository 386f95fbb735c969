"""Row 6: a rank stopped with SIGSTOP turns into a clear error on the other rank within the
configured collective timeout, and on the stopped rank itself once it runs again."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

RANK = textwrap.dedent("""
    import sys, torch
    import outcore
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(4)])
    engine = outcore.Engine(model, outcore.Config(stage=3, collective_timeout=float(sys.argv[1])))
    x = torch.randn(4, 64)
    try:
        for step in range(100000):
            engine.backward(engine(x).square().mean())
            engine.step()
            print(f"step {step + 1}", flush=True)
    except outcore.RanksLostError as e:
        print(f"lost: {e}", flush=True)
        sys.exit(3)
""")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_stopped_rank_is_an_error_on_every_rank(tmp_path):
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()),
           "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, "3"], env={**env, "RANK": str(r)}, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        for line in ranks[1].stdout:  # let both train, then stop rank 1 mid-run
            if line.startswith("step 3"):
                break
        os.kill(ranks[1].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        out0, _ = ranks[0].communicate(timeout=60)
        waited = time.monotonic() - stopped
        os.kill(ranks[1].pid, signal.SIGCONT)
        out1, _ = ranks[1].communicate(timeout=60)
    finally:
        for p in ranks:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
    assert ranks[0].returncode == 3, out0[-2000:]
    assert "lost: rank 0:" in out0 and "more than 3 s" in out0 and "collective_timeout" in out0
    assert waited < 30  # the timeout, not gloo's 30 minutes
    assert ranks[1].returncode == 3, out1[-2000:]
    assert "lost: rank 1:" in out1


def test_train_timeout_reaches_the_config(tmp_path, monkeypatch):
    from outcore.tools.train import TrainOptions, train

    monkeypatch.chdir(tmp_path)
    summary = train(TrainOptions(steps=1, batch=1, seq=16, save_final=False, eval_batches=1, collective_timeout=42.0),
                    report=lambda _: None)
    assert summary["config"]["collective_timeout"] == 42.0
