"""Numbers a user mistypes are one line and exit 2 before any work; a diverging run stops with the step."""

import pytest

from outcore.tools.cli import main
from outcore.tools.train import TrainOptions, train


@pytest.mark.parametrize("argv", [
    ["train", "--steps", "0"], ["train", "--lr", "0"], ["train", "--lr", "nan"], ["train", "--lr", "inf"],
    ["train", "--batch", "0"], ["train", "--batch", "-1"], ["train", "--eval-batches", "0"],
    ["train", "--prefetch-depth", "-1"], ["train", "--grad-clip", "-1"], ["train", "--timeout", "0"],
    ["estimate", "--params", "1B", "--world-size", "0"],
])
def test_a_bad_number_exits_2_with_one_line(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("outcore") and "is not" in err[-1] and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "outcore-run").exists()


@pytest.mark.slow
def test_a_diverging_run_stops_naming_the_step(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FloatingPointError, match="at step [0-9]+: training diverged"):
        train(TrainOptions(steps=12, lr=1e30, grad_clip=None, batch=2, seq=32, save_final=False, eval_every=100,
                           dtype="fp32"),
              report=lambda _: None)
