"""A save replaces only what outcore wrote: a user's folder under the tag's name, a user's files under
the temporary names, and a link planted where `latest` is written are refused and left as they are."""

import os

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


@pytest.mark.parametrize("name", [".best.tmp", ".best.old"])
def test_user_files_under_the_temporary_names_are_refused_and_kept(tmp_path, engine, name):
    held = tmp_path / "ckpt" / name
    held.mkdir(parents=True)
    (held / "thesis.tex").write_text("mine")
    with pytest.raises(ValueError, match="holds what outcore did not write"):
        engine.save_checkpoint(str(tmp_path / "ckpt"), "best")
    assert (held / "thesis.tex").read_text() == "mine"


def test_a_link_planted_where_latest_is_written_is_not_followed(tmp_path, engine):
    target = tmp_path / "precious.txt"
    target.write_text("mine")
    (tmp_path / "ckpt").mkdir()
    os.symlink(target, tmp_path / "ckpt" / ".latest.tmp")
    with pytest.raises(ValueError, match="is a link or not a file"):
        engine.save_checkpoint(str(tmp_path / "ckpt"), "step1")
    assert target.read_text() == "mine" and os.path.islink(tmp_path / "ckpt" / ".latest.tmp")
    assert not (tmp_path / "ckpt" / "latest").exists()


def test_a_dead_save_s_leftovers_are_cleared(tmp_path, engine):
    leftover = tmp_path / "ckpt" / ".step1.tmp"
    leftover.mkdir(parents=True)
    (leftover / "rank0.safetensors").write_bytes(b"half")
    (tmp_path / "ckpt" / ".latest.tmp").write_text("step0\n")
    engine.save_checkpoint(str(tmp_path / "ckpt"), "step1")
    assert not leftover.exists() and (tmp_path / "ckpt" / "latest").read_text().strip() == "step1"
