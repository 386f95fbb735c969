"""A script that ends without `close()`, its updates and write-backs still in flight: it exits
cleanly, and its swap files go (offload/exit_close.py)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Every swap-file write is slowed, so the last step's updates are surely still running at exit.
SLOW_WRITES = r"""
import sys, time
from outcore.offload import io_engine
real = io_engine._pwrite_full
def slow(fd, view, offset):
    time.sleep(0.02)
    real(fd, view, offset)
io_engine._pwrite_full = slow
nvme = sys.argv[1]
"""

ENGINE = SLOW_WRITES + r"""
import outcore
from tests.runtime.models import TinyGPT, batches
cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=nvme,
                     io={"block_size": 64 << 10, "threads": 2})
engine = outcore.Engine(TinyGPT(), cfg, outcore.AdamW(lr=1e-3))
for x, y in batches(3):
    engine.backward(engine(x, y))
    engine.step()
assert engine.updates.in_flight(), "nothing in flight: the test would not test the exit"
print("steps done", flush=True)
"""

STORE = SLOW_WRITES + r"""
import torch
from outcore.offload import Tier, TieredStore
store = TieredStore(nvme, host_budget=1 << 20, device_budget=1 << 20)
for i in range(8):
    store.put(f"k{i}", torch.full((1 << 16,), float(i)), Tier.NVME)
print("puts done", flush=True)
"""


@pytest.mark.parametrize("script", [ENGINE, STORE], ids=["engine", "store"])
def test_a_script_that_never_closes_exits_cleanly_and_leaves_no_swap_file(tmp_path, script):
    nvme = tmp_path / "nvme"
    res = subprocess.run([sys.executable, "-c", script, str(nvme)], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "done" in res.stdout
    assert "Traceback" not in res.stderr and "cannot schedule" not in res.stderr, res.stderr[-3000:]
    assert not [n for n in os.listdir(nvme) if n.endswith(".swap")], os.listdir(nvme)
