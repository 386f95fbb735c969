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


def test_under_max_memory_the_host_room_of_paged_activations_is_sized_from_the_bound(tmp_path):
    """The engine would size it from the machine's free memory; train gives it an eighth of
    --max-memory, counted with the activations in the arithmetic."""
    assert main(["train", "--steps", "1", "--batch", "2", "--seq", "32", "--dtype", "fp32", "--no-save",
                 "--checkpoint-activations", "--offload-activations", "nvme", "--max-memory", "4G",
                 "--out", str(tmp_path / "r"), "--json", str(tmp_path / "r.json")]) == 0
    report = json.load(open(tmp_path / "r.json"))
    room = (4 << 30) // 8
    assert report["config"]["host_budget"] == report["memory"]["host_budget"] + room
    assert report["memory"]["activations"] >= room  # counted there
