"""Round 4, items 1, 2, 5 and 9: a resume writes only into the OUT it is given (a copied or moved run
goes on where it now is, on the files it read), a data file whose bytes changed since the run
started is refused unless --data-changed-ok says to go on, a resume on another number of ranks keeps
the rows a step or is refused, and OUT/run.json's values are checked as the flags are."""

import json
import os
import shutil

import pytest

from outcore.tools.cli import main

TINY = ["train", "--batch", "2", "--seq", "16", "--dtype", "fp32", "--eval-every", "100", "--eval-batches", "1",
        "--offload-params", "cpu", "--offload-optimizer", "cpu", "--log-every", "1"]


@pytest.fixture
def first_run(tmp_path, monkeypatch):
    """A 2-step run in C0 on a text file given by a relative path, from tmp_path/work."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    (work / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    assert main([*TINY, "--steps", "2", "--data", "text.txt", "--out", "C0"]) == 0
    return work


def tags(folder) -> set[str]:
    return {name for name in os.listdir(folder) if name.startswith("step")}


def test_a_copied_run_resumes_in_the_copy_and_leaves_the_original_alone(first_run, tmp_path, monkeypatch):
    shutil.copytree(first_run / "C0", first_run / "C1")
    before = tags(first_run / "C0" / "checkpoints")
    monkeypatch.chdir(tmp_path)  # another working directory: the data path was relative to the first
    assert main(["train", "--out", str(first_run / "C1"), "--resume", "--steps", "3"]) == 0
    assert tags(first_run / "C0" / "checkpoints") == before == {"step2"}
    assert tags(first_run / "C1" / "checkpoints") == {"step2", "step3"}
    record = json.load(open(first_run / "C1" / "run.json"))
    assert "out" not in record and record["data"] == [str(first_run / "text.txt")]


def test_a_moved_run_resumes_where_it_now_is(first_run, capsys):
    os.rename(first_run / "C0", first_run / "M1")
    capsys.readouterr()
    assert main(["train", "--out", "M1", "--resume", "--steps", "3"]) == 0
    assert "C0" not in capsys.readouterr().err
    assert tags(first_run / "M1" / "checkpoints") == {"step2", "step3"} and not (first_run / "C0").exists()


def test_a_data_file_inside_the_run_directory_moves_with_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs("R0")
    (tmp_path / "R0" / "text.txt").write_text("a stitch in time saves nine. " * 200)
    assert main([*TINY, "--steps", "1", "--data", "R0/text.txt", "--out", "R0"]) == 0
    assert json.load(open("R0/run.json"))["data"] == ["text.txt"]
    os.rename("R0", "R1")
    assert main(["train", "--out", "R1", "--resume", "--steps", "2"]) == 0
    assert tags(tmp_path / "R1" / "checkpoints") == {"step1", "step2"}


def test_a_data_file_whose_bytes_changed_is_refused_naming_it(first_run, capsys):
    (first_run / "text.txt").write_text("another text altogether, " * 300)
    capsys.readouterr()
    assert main(["train", "--out", "C0", "--resume", "--steps", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(first_run / "text.txt") in err and "changed since the run started" in err
    assert "--data-changed-ok" in err and tags(first_run / "C0" / "checkpoints") == {"step2"}
    assert main(["train", "--out", "C0", "--resume", "--steps", "3", "--data-changed-ok"]) == 0
    assert "--data-changed-ok: " + str(first_run / "text.txt") in capsys.readouterr().out
    assert main(["train", "--out", "C0", "--resume", "--steps", "4"]) == 0  # the record now holds the new bytes


def test_the_same_size_with_other_bytes_is_a_change(first_run, capsys):
    text = (first_run / "text.txt").read_text()
    (first_run / "text.txt").write_text(text.replace("fox", "cat"))
    assert main(["train", "--out", "C0", "--resume", "--steps", "3"]) == 2
    assert "the same size but other bytes" in capsys.readouterr().err


def test_a_resume_on_other_ranks_that_changes_the_rows_a_step_is_refused(first_run, capsys):
    record = json.load(open(first_run / "C0" / "run.json"))
    json.dump({**record, "world": 2}, open(first_run / "C0" / "run.json", "w"))  # as two ranks had written it
    assert main(["train", "--out", "C0", "--resume", "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "took 4 rows a step (2 rank(s) of --batch 2)" in err and "give --batch 4 to keep them" in err
    assert main(["train", "--out", "C0", "--resume", "--steps", "3", "--batch", "4"]) == 0
    assert "--batch 4 on 1 rank(s) (the run had 2 on each of 2: the same rows a step)" in capsys.readouterr().out


@pytest.mark.parametrize("key, value, said", [
    ("steps", "abc", "'steps' is \"abc\", not what --steps takes"),
    ("lora", "four", "'lora' is \"four\", not what --lora takes"),
    ("batch", -3, "'batch' is -3, not what --batch takes"),
    ("dtype", "fp64", "'dtype' is \"fp64\", not one of fp32, bf16, fp16"),
    ("dora", "yes", "'dora' is \"yes\", not true or false"),
    ("data", "text.txt", "'data' is \"text.txt\", not a list"),
    ("world", "2", "'world' is \"2\", not a int"),
    ("stepz", 3, "'stepz' is 3, not a flag of outcore train"),
    ("out", "C9", "'out' is \"C9\", not a flag of outcore train"),
])
def test_a_hand_edited_record_is_refused_naming_the_key(first_run, capsys, key, value, said):
    record = json.load(open(first_run / "C0" / "run.json"))
    json.dump({**record, key: value}, open(first_run / "C0" / "run.json", "w"))
    capsys.readouterr()
    assert main(["train", "--out", "C0", "--resume", "--steps", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err and "run.json" in err, err
    assert tags(first_run / "C0" / "checkpoints") == {"step2"}


def test_data_changed_ok_without_resume_is_refused(tmp_path, capsys):
    assert main([*TINY, "--data-changed-ok", "--out", str(tmp_path / "r")]) == 2
    assert "--data-changed-ok is for a resume" in capsys.readouterr().err
