"""Round 2's small ones: a prefetch depth past any use is a config error, not an OSError mid-run; a
tag that would not read back as itself (whitespace, a control character) is refused."""

import pytest
import torch

import outcore
from outcore.runtime.checkpoint_folder import is_tag
from outcore.tools.cli import main


def test_a_prefetch_depth_past_any_use_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(ValueError, match="prefetch_depth=1000000000: must be between 0 and 1024"):
        outcore.Config(prefetch_depth=10**9)
    assert main(["train", "--steps", "1", "--prefetch-depth", "1000000000", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prefetch_depth" in err[0] and not (tmp_path / "run").exists()


@pytest.mark.parametrize("tag", ["c\n", " c2", "c2 ", "a\tb", ".hidden", "a/b", ""])
def test_a_tag_that_would_not_read_back_as_itself_is_refused(tmp_path, tag):
    assert not is_tag(tag)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    engine = outcore.Engine(model, outcore.Config(), outcore.AdamW(lr=1e-3))
    with pytest.raises(ValueError, match="use a plain name"):
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag=tag)
    engine.close()
    assert is_tag("step100") and is_tag("best-2026_12_06")
