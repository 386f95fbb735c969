"""A disk too small for the model: refused before the first byte when the free space says so, and
when it fills during the start, one error and no half-grown swap file left filling the disk."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import outcore

FILLS = textwrap.dedent("""
    import os, resource, signal, sys, torch
    import outcore
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG back instead of dying
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))  # the disk takes 4 MiB per file
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(40)])  # ~10 MiB of fp32 states
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=sys.argv[1],
                         io=outcore.IOConfig(block_size=1 << 16))
    try:
        outcore.Engine(torch.nn.Sequential(torch.nn.Module(), model), cfg)
    except outcore.StorageFullError as e:
        print("full:", e)
    print(sorted(os.listdir(sys.argv[1])))
""")


def test_a_disk_that_fills_while_starting_leaves_no_swap_file(tmp_path):
    res = subprocess.run([sys.executable, "-c", FILLS, str(tmp_path / "nvme")], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    assert lines[0].startswith("full:") and str(tmp_path / "nvme") in lines[0]
    assert lines[-1] == "[]", "the half-grown swap file (and its lock) must be gone"


def test_free_space_below_the_states_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"))
    with pytest.raises(outcore.StorageFullError, match=r"more bytes are needed \(1,048,576 bytes free\)"):
        outcore.Engine(torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]), cfg)
    assert os.listdir(tmp_path / "nvme") == []
