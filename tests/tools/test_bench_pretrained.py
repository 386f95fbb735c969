"""The pretrained-model benchmark's arguments: a shape it cannot build is refused before anything is written."""

import os

import pytest

from outcore.tools.kit.bench_pretrained import main


@pytest.mark.parametrize(("argv", "message"), [
    (["--hidden", "64"], "--hidden 64: give a multiple of 256"),
    (["--kinds", "load,nope"], "--kinds load,nope: choose from load, lora, full, plain-lora"),
    (["--layers", "0"], "'0' is not a whole number of at least 1"),
])
def test_a_shape_it_cannot_build_is_one_line_and_writes_nothing(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["--dir", str(tmp_path / "bench"), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "bench")
