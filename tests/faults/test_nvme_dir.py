"""The NVMe directory is the run's own: links planted in it are not followed, a loose mode is
tightened, a file in its place is refused, a second live run is refused by name, and a dead run's
directory is taken over."""

import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from outcore.offload import StorageError, Tier, TieredStore

HOLD = textwrap.dedent("""
    import sys, time
    from outcore.offload import TieredStore
    store = TieredStore(sys.argv[1], "cpu", 1 << 20, 1 << 20)
    print("ready", flush=True)
    time.sleep(120)
""")


def holder(directory) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_symlink_planted_as_the_swap_file_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("do not overwrite")
    nvme = tmp_path / "nvme"
    nvme.mkdir(mode=0o700)
    os.symlink(victim, nvme / "rank0.swap")
    with pytest.raises(StorageError, match="symbolic link"):
        TieredStore(str(nvme), "cpu", 1 << 20, 1 << 20)
    assert victim.read_text() == "do not overwrite"
    assert not (nvme / "rank0.lock").exists()  # a refused start leaves nothing of its own behind


def test_a_symlink_planted_as_the_index_is_not_followed(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("do not overwrite")
    store = TieredStore(str(tmp_path / "nvme"), "cpu", 1 << 20, 1 << 20)
    store.put("k", torch.ones(10), Tier.NVME)
    os.symlink(victim, tmp_path / "nvme" / "rank0.index.json.tmp")
    with pytest.raises(StorageError, match="symbolic link"):
        store.flush()
    assert victim.read_text() == "do not overwrite"
    os.unlink(tmp_path / "nvme" / "rank0.index.json.tmp")
    store.close()


def test_a_directory_open_to_others_is_tightened_to_0700(tmp_path, caplog):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    os.chmod(nvme, 0o777)
    with caplog.at_level("WARNING"):
        store = TieredStore(str(nvme), "cpu", 1 << 20, 1 << 20)
    assert stat.S_IMODE(os.stat(nvme).st_mode) == 0o700
    assert any("tightened to 0700" in r.message for r in caplog.records)
    store.close()


def test_an_engine_whose_nvme_dir_is_a_file_is_refused_and_the_file_kept(tmp_path):
    import outcore
    from outcore.tools.gpt import GPT, PRESETS

    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    cfg = outcore.Config(offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(taken))
    with pytest.raises(StorageError, match="notes.txt' exists and is not a directory; name a directory"):
        outcore.Engine(GPT(PRESETS["tiny"]), cfg)
    assert taken.read_text() == "mine"


def test_a_second_live_run_on_the_directory_is_refused_naming_the_holder(tmp_path):
    proc = holder(tmp_path / "nvme")
    try:
        with pytest.raises(StorageError, match=f"in use by another live run \\(pid {proc.pid}"):
            TieredStore(str(tmp_path / "nvme"), "cpu", 1 << 20, 1 << 20)
        assert (tmp_path / "nvme" / "rank0.swap").exists()  # the live run's file, untouched
        other_rank = TieredStore(str(tmp_path / "nvme"), "cpu", 1 << 20, 1 << 20, rank=1)  # a rank of its own
        other_rank.close()
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_runs_directory_is_taken_over_by_the_next_run(tmp_path):
    proc = holder(tmp_path / "nvme")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (tmp_path / "nvme" / "rank0.lock").exists()  # left behind by kill -9
    store = TieredStore(str(tmp_path / "nvme"), "cpu", 1 << 20, 1 << 20)
    store.put("k", torch.arange(5.0), Tier.NVME)
    assert torch.equal(store.fetch("k", Tier.HOST).result(), torch.arange(5.0))
    store.release("k")
    store.close()
    assert os.listdir(tmp_path / "nvme") == []  # scratch reclaimed and removed
