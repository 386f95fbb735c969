"""A disk too small for the model: refused before the first byte when the free space says so, and
when it fills during the start, one error and no half-grown swap file left filling the disk. A disk
that fills later: write-backs keep their bytes in memory and close cleanly, and a checkpoint names
the file it could not write and leaves no partial folder."""

import errno
import json
import math
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
    print(sorted(os.listdir(sys.argv[1])) if os.path.exists(sys.argv[1]) else "gone")
""")


@pytest.mark.slow
def test_a_disk_that_fills_while_starting_leaves_no_swap_file(tmp_path):
    res = subprocess.run([sys.executable, "-c", FILLS, str(tmp_path / "nvme")], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    assert lines[0].startswith("full:") and str(tmp_path / "nvme") in lines[0]
    assert lines[-1] == "gone", "the half-grown swap file, its lock and the folder made for them must be gone"


def test_free_space_below_the_states_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"))
    with pytest.raises(outcore.StorageFullError, match=r"more bytes are needed \(1,048,576 bytes free\)"):
        outcore.Engine(torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]), cfg)
    assert os.listdir(tmp_path / "nvme") == []


def _full_disk(*_args):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_failed_write_backs_keep_their_bytes_and_close_still_ends_clean(make_store, monkeypatch):
    """Row 9: writes failing with ENOSPC (a stand-in for a full filesystem) leave the bytes in memory;
    closing the store, whose swap file is scratch, neither raises nor leaves the file behind."""
    from outcore.offload import io_engine

    store = make_store(host_budget=1 << 20)
    for i in range(4):
        store.put(f"k{i}", torch.full((1024,), float(i)), outcore.Tier.NVME)
    store.flush()
    monkeypatch.setattr(io_engine, "_pwrite_full", _full_disk)
    for i in range(4):
        store.fetch(f"k{i}", outcore.Tier.HOST).result().add_(10.0)
        store.release(f"k{i}", dirty=True)
        with pytest.raises(outcore.StorageFullError):
            store.evict(f"k{i}", outcore.Tier.NVME).wait()
    assert store.stats()["writes_failed"] == 4
    for i in range(4):
        assert torch.equal(store.fetch(f"k{i}", outcore.Tier.HOST).result(), torch.full((1024,), i + 10.0))
        store.release(f"k{i}")
    swap = store.state.swap.path
    store.close()  # nothing to raise: the swap file goes, and the bytes were never lost
    assert not os.path.exists(swap)


def test_a_store_that_keeps_its_files_reports_a_failed_write(make_store, monkeypatch):
    from outcore.offload import io_engine

    store = make_store()
    monkeypatch.setattr(io_engine, "_pwrite_full", _full_disk)
    store.put("k", torch.ones(1024), outcore.Tier.NVME)
    with pytest.raises(outcore.StorageFullError):
        store.close(keep_files=True)
    os.unlink(store.state.swap.path)  # kept, as asked


SAVES = textwrap.dedent("""
    import json, os, resource, signal, sys, torch
    import outcore
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG back instead of dying
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(128, 128)) for _ in range(4)])
    engine = outcore.Engine(model, outcore.Config(stage=3))
    engine.backward(engine(torch.randn(2, 128)).square().mean())
    engine.step()
    engine.save_checkpoint(sys.argv[1], "good")
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))  # 64 KiB per file from now
    try:
        engine.save_checkpoint(sys.argv[1], "bad")
    except outcore.StorageError as e:
        print("error:", e)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # room again
    print(json.dumps(sorted(os.listdir(sys.argv[1]))))
    print(engine.load_checkpoint(sys.argv[1])["tag"])
    engine.close()
""")


@pytest.mark.slow
def test_a_checkpoint_that_fills_the_disk_names_the_file_and_leaves_nothing_half_written(tmp_path):
    """Row 9: a real EFBIG from the kernel (a per-process file size limit) in the middle of a save."""
    ckpt = tmp_path / "ckpt"
    res = subprocess.run([sys.executable, "-c", SAVES, str(ckpt)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    error, listing, loaded = res.stdout.strip().splitlines()
    assert error.startswith(f"error: checkpoint {str(ckpt / 'bad')!r}: writing ")
    assert "rank0.safetensors" in error and "File too large" in error and "partial save was removed" in error
    assert json.loads(listing) == [".outcore-rank0.lock", "good", "latest"]  # no temporary folder; the run's lock
    assert loaded == "good"


def test_a_run_whose_last_writes_fail_still_succeeds_and_writes_its_json(tmp_path, monkeypatch):
    """Row 9, end to end: the disk fills during the last step, so the write-backs still in flight
    at the end fail. Their bytes stayed in memory and the swap file is scratch: the run ends 0 and
    its --json is written (the store no longer flushes into a file it is about to delete)."""
    from outcore.offload import io_engine
    from outcore.tools.cli import main
    from outcore.tools.lr_schedules import Schedule

    real_rate, failed = Schedule.rate, []

    def last_step_fills_the_disk(schedule, step):
        if step == schedule.steps - 1:
            monkeypatch.setattr(io_engine, "_pwrite_full", full)
        return real_rate(schedule, step)

    def full(fd, view, offset):
        failed.append(offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(Schedule, "rate", last_step_fills_the_disk)
    assert main(["train", "--steps", "4", "--batch", "1", "--seq", "16", "--eval-batches", "1", "--no-save",
                 "--offload-params", "nvme", "--offload-optimizer", "nvme", "--dtype", "fp32",
                 "--json", "run.json"]) == 0
    assert failed, "the last step's write-backs must have met the full disk"
    summary = json.loads((tmp_path / "run.json").read_text())
    assert len(summary["losses"]) == 4 and all(map(math.isfinite, summary["losses"]))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".outcore-nvme-")]
