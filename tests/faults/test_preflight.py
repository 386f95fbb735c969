"""Paths the run will write to are checked before the first step, not found bad after the last."""

import pytest

from outcore.tools.cli import main


@pytest.mark.parametrize(("flag", "target"), [("--out", "afile"), ("--json", "adir"), ("--nvme-dir", "afile"),
                                              ("--out", "afile/run"), ("--json", "afile/summary.json")])
def test_an_unwritable_output_is_exit_2_before_any_training(tmp_path, monkeypatch, capsys, flag, target):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    assert main(["train", "--steps", "1", flag, str(tmp_path / target)]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err and "step 1" not in err
    assert not (tmp_path / "outcore-run").exists()


def _checkpoints_a_file(run):
    run.mkdir()
    (run / "checkpoints").write_text("x")


def _a_step_folder_not_ours(run):
    (run / "checkpoints" / "step3").mkdir(parents=True)  # a step a stop by a signal could save under
    (run / "checkpoints" / "step3" / "notes.txt").write_text("mine")


def _tensorboard_a_dangling_link(run):
    run.mkdir()
    (run / "tensorboard").symlink_to(run / "nowhere")


def _wandb_a_link(run):
    run.mkdir()
    (run.parent / "elsewhere").mkdir()
    (run / "wandb").symlink_to(run.parent / "elsewhere")


@pytest.mark.parametrize(("plant", "extra", "words"), [
    (_checkpoints_a_file, [], "is a file, where the run saves its checkpoints"),
    (_a_step_folder_not_ours, [], "step3' is not an outcore checkpoint"),
    (_tensorboard_a_dangling_link, ["--report-to", "tensorboard"], "is a symbolic link"),
    (_wandb_a_link, ["--report-to", "wandb"], "is a symbolic link")])
def test_what_lies_in_the_way_under_out_is_refused_before_step_1(tmp_path, capsys, plant, extra, words):
    run = tmp_path / "run"
    plant(run)
    before = sorted(p.name for p in run.rglob("*"))
    assert main(["train", "--steps", "4", "--save-every", "2", "--out", str(run), *extra]) == 2
    said = capsys.readouterr()
    assert words in said.err and "Traceback" not in said.err and "step 1" not in said.out
    assert sorted(p.name for p in run.rglob("*")) == before
    assert not (tmp_path / "elsewhere").exists() or not list((tmp_path / "elsewhere").iterdir())


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_json_through_a_link_or_into_a_fifo_is_refused_before_any_training(tmp_path, capsys, kind):
    import os

    target = tmp_path / "summary.json"
    if kind == "link":
        (tmp_path / "real.json").write_text("keep")
        target.symlink_to(tmp_path / "real.json")
    else:
        os.mkfifo(target)
    assert main(["train", "--steps", "1", "--out", str(tmp_path / "run"), "--json", str(target)]) == 2
    assert "--json" in capsys.readouterr().err
    if kind == "link":
        assert (tmp_path / "real.json").read_text() == "keep"
