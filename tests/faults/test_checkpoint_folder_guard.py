"""A save replaces only what outcore wrote: a user's folder under the tag's name or under `.<tag>.old` is
refused and left as it is; names a save does not write (its temporary names are its own) are left
alone, links planted there included; one run at a time saves into a directory; an nvme_dir inside the
checkpoint directory is refused."""

import os
import subprocess
import sys

import pytest
import torch

import outcore


@pytest.fixture
def engine(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    e = outcore.Engine(model, outcore.Config(), outcore.AdamW(lr=1e-3))
    yield e
    e.close()


def test_a_user_folder_under_the_tag_s_name_is_refused_and_kept(tmp_path, engine):
    mine = tmp_path / "ckpt" / "best"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not an outcore checkpoint"):
        engine.save_checkpoint(str(tmp_path / "ckpt"), "best")
    assert (mine / "notes.txt").read_text() == "mine"
    engine.save_checkpoint(str(tmp_path / "ckpt"), "step1")  # a checkpoint of its own is replaced as before
    engine.save_checkpoint(str(tmp_path / "ckpt"), "step1")
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step1"


def test_user_files_under_the_old_name_are_refused_and_kept(tmp_path, engine):
    held = tmp_path / "ckpt" / ".best.old"  # where a re-save keeps the tag's previous folder
    held.mkdir(parents=True)
    (held / "thesis.tex").write_text("mine")
    with pytest.raises(ValueError, match="holds what outcore did not write"):
        engine.save_checkpoint(str(tmp_path / "ckpt"), "best")
    assert (held / "thesis.tex").read_text() == "mine"


def test_names_a_save_does_not_write_are_left_alone(tmp_path, engine):
    """Its temporary names are its own: a user's folder, or a planted link, under a name an older
    outcore used is neither followed nor removed, and the save goes ahead."""
    ckpt = tmp_path / "ckpt"
    (ckpt / ".best.tmp").mkdir(parents=True)
    (ckpt / ".best.tmp" / "thesis.tex").write_text("mine")
    target = tmp_path / "precious.txt"
    target.write_text("mine")
    os.symlink(target, ckpt / ".latest.tmp")
    engine.save_checkpoint(str(ckpt), "best")
    assert (ckpt / ".best.tmp" / "thesis.tex").read_text() == "mine"
    assert target.read_text() == "mine" and os.path.islink(ckpt / ".latest.tmp")
    assert not os.path.islink(ckpt / "latest") and (ckpt / "latest").read_text() == "best\n"
    assert sorted(os.listdir(ckpt)) == [".best.tmp", ".latest.tmp", ".outcore-rank0.lock", "best", "latest"]


def test_a_dead_save_s_leftovers_are_cleared(tmp_path, engine):
    ckpt = tmp_path / "ckpt"
    leftover = ckpt / ".step1.4242-0123abcd.tmp"  # a save killed midway, by the name it wrote under
    leftover.mkdir(parents=True)
    (leftover / "rank0.safetensors").write_bytes(b"half")
    (ckpt / ".latest.4242-89abcdef.tmp").write_text("step0\n")
    mixed = ckpt / ".step2.4243-0123abcd.tmp"  # the same name, but a user's file inside: kept
    mixed.mkdir()
    (mixed / "notes.txt").write_text("mine")
    engine.save_checkpoint(str(ckpt), "step1")
    assert not leftover.exists() and not (ckpt / ".latest.4242-89abcdef.tmp").exists()
    assert (mixed / "notes.txt").read_text() == "mine"
    assert (ckpt / "latest").read_text().strip() == "step1"


@pytest.mark.slow
def test_a_second_run_saving_into_the_same_directory_is_refused(tmp_path, engine):
    engine.save_checkpoint(str(tmp_path / "ckpt"), "step1")
    other = subprocess.run([sys.executable, "-c", SECOND_RUN, str(tmp_path / "ckpt")], capture_output=True,
                           text=True, timeout=120)
    assert other.returncode == 3, other.stdout + other.stderr
    assert f"is in use by another live run (pid {os.getpid()}" in other.stdout
    assert "checkpoint directory" in other.stdout
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".outcore-rank0.lock", "latest", "step1"]
    engine.save_checkpoint(str(tmp_path / "ckpt2"), "step1")  # moving on lets the first directory go
    assert subprocess.run([sys.executable, "-c", SECOND_RUN, str(tmp_path / "ckpt")], capture_output=True,
                          timeout=120).returncode == 0


SECOND_RUN = """
import sys, torch, outcore
engine = outcore.Engine(torch.nn.Linear(4, 4), outcore.Config())
try:
    engine.save_checkpoint(sys.argv[1], "step9")
except outcore.StorageError as e:
    print(e)
    sys.exit(3)
finally:
    engine.close()
"""


def test_an_nvme_dir_inside_the_checkpoint_directory_is_refused(tmp_path, engine):
    engine.save_checkpoint(str(tmp_path / "ckpt"), "best")
    engine.close()
    nvme = tmp_path / "ckpt" / "best" / "swap"  # inside a checkpoint that a save of "best" replaces
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    second = outcore.Engine(model, outcore.Config(offload_params="nvme", nvme_dir=str(nvme)))
    try:
        for tag in ("best", "other"):
            with pytest.raises(ValueError, match="holds this engine's nvme_dir"):
                second.save_checkpoint(str(tmp_path / "ckpt"), tag)
        assert {"rank0.lock", "rank0.swap"} <= set(os.listdir(nvme))
        with pytest.raises(outcore.StorageError, match="in use by another live run"):
            outcore.Engine(torch.nn.Linear(4, 4), outcore.Config(offload_params="nvme", nvme_dir=str(nvme)))
    finally:
        second.close()
