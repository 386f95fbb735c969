"""glibc's mmap threshold, pinned by the engine from its budgets (runtime/host_heap.py): what a
buffer freed and allocated again costs in page faults, in a fresh process each."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from outcore.runtime.host_heap import LEAN_THRESHOLD, THRESHOLD, mmap_threshold_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

# Builds an engine under the given budgets, frees an 8 MiB tensor while one allocated after it
# lives on, as in a step (else the freed chunk tops the heap and glibc trims it), and allocates
# 6 MiB: from the heap, in the pages the first one touched; mmapped afresh, each of its 1536 pages
# faults. (Not 8 MiB again: torch asks for aligned memory, which an equal free chunk cannot hold.)
CHILD = r"""
import json, resource, sys, torch, outcore
from tests.runtime.models import TinyGPT
host, device, nvme = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=nvme,
                     host_budget=host, device_budget=device)
engine = outcore.Engine(TinyGPT(), cfg, outcore.AdamW(lr=1e-3))
buffer = torch.empty(2 << 20, dtype=torch.float32).fill_(1.0)  # 8 MiB
later = [torch.ones(1 << 16)]  # 256 KiB each, until one lies above it (the first may fill a hole below)
while later[-1].data_ptr() < buffer.data_ptr() and len(later) < 256:
    later.append(torch.ones(1 << 16))
del buffer
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(3 << 19, dtype=torch.float32).fill_(1.0)
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
engine.close()
"""


def _faults(tmp_path, host: int, device: int, env: dict | None = None) -> int:
    res = subprocess.run([sys.executable, "-c", CHILD, str(host), str(device), str(tmp_path / "nvme")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])["faults"]


def test_the_threshold_follows_the_budgets_in_ram():
    assert mmap_threshold_for(0) == mmap_threshold_for((1 << 30) - 1) == LEAN_THRESHOLD == 4 << 20
    assert mmap_threshold_for(1 << 30) == mmap_threshold_for(64 << 30) == THRESHOLD == 16 << 20


@pytest.mark.slow
def test_ample_budgets_reuse_freed_buffers_lean_ones_return_them(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    ample = _faults(tmp_path, 1 << 30, 256 << 20, env)
    lean = _faults(tmp_path, 256 << 20, 256 << 20, env)
    assert ample < 256, f"6 MiB asked for after 8 MiB were freed faulted {ample} pages under ample budgets"
    assert lean >= 1500, f"under lean budgets a 6 MiB buffer is a fresh mapping each time; it faulted {lean}"
    # The user's own setting wins over the engine's.
    assert _faults(tmp_path, 256 << 20, 256 << 20, {"MALLOC_MMAP_THRESHOLD_": str(32 << 20)}) < 256
