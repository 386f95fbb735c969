"""`outcore train --offload-activations`: the run's activations page as asked, its losses are the
unpaged run's, and `--json` and the closing line say what a step paged and read back."""

import json

import pytest

from outcore.runtime import saved_activations
from outcore.tools.cli import main


def test_activations_paged_to_nvme_are_reported_and_change_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(saved_activations, "PAGED_BYTES", 1 << 10)
    run = ["train", "--steps", "2", "--batch", "2", "--seq", "32", "--dtype", "fp32", "--no-save",
           "--checkpoint-activations", "--offload-params", "nvme", "--offload-optimizer", "nvme"]
    for mode in ("none", "nvme"):
        assert main([*run, "--offload-activations", mode, "--out", str(tmp_path / mode),
                     "--json", str(tmp_path / f"{mode}.json")]) == 0
    out = capsys.readouterr().out
    plain, paged = (json.load(open(tmp_path / f"{mode}.json")) for mode in ("none", "nvme"))
    assert paged["losses"] == plain["losses"]
    assert plain["activation_bytes_paged_per_step"] == 0 < paged["activation_bytes_paged_per_step"]
    assert 0 < paged["activation_bytes_read_per_step"] <= paged["activation_bytes_paged_per_step"]
    assert paged["config"]["offload_activations"] == "nvme"
    assert out.count("paged and") == 1 and "read back from NVMe a step" in out


def test_an_unknown_place_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--offload-activations", "disk", "--out", str(tmp_path / "r")])
    assert "--offload-activations: invalid choice: 'disk'" in capsys.readouterr().err
