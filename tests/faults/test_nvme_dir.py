"""The NVMe directory is the run's own: links planted in it are not followed, a folder outcore did not
create keeps its mode, a shared one gets a private subfolder, a file in its place is refused, a second
live run is refused by name, and a dead run's directory is taken over."""

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


def test_a_shared_directory_gets_a_private_subfolder_and_keeps_its_mode(tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # a /tmp of its own
    with caplog.at_level("WARNING"):
        store = TieredStore(str(shared), "cpu", 1 << 20, 1 << 20)
    private = shared / f"outcore-{os.getuid()}"
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o1777
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700 and (private / "rank0.lock").exists()
    assert sum("writable by other users" in r.message for r in caplog.records) == 1
    store.close()


def test_a_planted_link_as_the_private_subfolder_is_refused(tmp_path):
    shared, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    shared.mkdir()
    elsewhere.mkdir()
    os.chmod(shared, 0o1777)
    os.symlink(elsewhere, shared / f"outcore-{os.getuid()}")
    with pytest.raises(StorageError, match="not a private folder of yours"):
        TieredStore(str(shared), "cpu", 1 << 20, 1 << 20)
    assert os.listdir(elsewhere) == []


@pytest.mark.parametrize("linked", [False, True])
def test_a_directory_outcore_did_not_create_keeps_its_mode(tmp_path, linked):
    folder = tmp_path / "mine"
    folder.mkdir()
    os.chmod(folder, 0o755)
    named = folder
    if linked:  # the user's own link to it: followed, and the folder behind it left as it is
        named = tmp_path / "link"
        os.symlink(folder, named)
    store = TieredStore(str(named), "cpu", 1 << 20, 1 << 20)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o755 and (folder / "rank0.lock").exists()
    store.close()
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o755


def test_a_path_too_long_is_refused_and_leaves_no_folders(tmp_path):
    deep = tmp_path / "/".join(["d" * 240] * 21)  # past PATH_MAX only at its 17th folder
    with pytest.raises(StorageError, match="cannot create nvme_dir"):
        TieredStore(str(deep), "cpu", 1 << 20, 1 << 20)
    assert os.listdir(tmp_path) == []


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


@pytest.mark.slow
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


def test_two_ranks_making_the_same_nvme_dir_at_once_both_go_on(tmp_path, monkeypatch):
    """The other rank makes the folder between this one's look and its mkdir."""
    from outcore.offload import scratch_dir

    real = os.mkdir

    def raced(path, mode=0o777):
        real(path, mode)  # the other rank, first
        raise FileExistsError(17, "File exists", path)

    monkeypatch.setattr(scratch_dir.os, "mkdir", raced)
    assert scratch_dir.prepare_directory(str(tmp_path / "a" / "b")) == str(tmp_path / "a" / "b")
