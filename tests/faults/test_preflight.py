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
