"""`outcore estimate` ends with a verdict for this machine: what it detected, fits or not, and the
flags to paste, with which `outcore train` starts; `--predict` without a placement predicts the
recommended one; an MFU above what was measured is not printed."""

import json

import pytest

from outcore.tools.cli import main
from outcore.tools.estimate_verdict import Machine, verdict
from outcore.tools.model_source import synthetic_unit_numels


def fake_disk(tmp_path) -> str:
    path = tmp_path / "disk.json"
    path.write_text(json.dumps({"results": [{"read_MBps": 2000.0, "write_MBps": 1000.0}], "best_read": 0,
                                "best_write": 0}))
    return str(path)


def test_the_verdict_s_flags_start_a_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["estimate", "--model", "tiny", "--batch", "2", "--seq", "32", "--json", "e.json"]) == 0
    out = capsys.readouterr().out
    assert "this machine: " in out and " RAM available, " in out and "free where --nvme-dir . lies" in out
    got = json.load(open("e.json"))["verdict"]
    assert got["fits"] and f"  outcore train ... {got['flags']}" in out
    flags = got["flags"].split()
    assert flags[flags.index("--device-budget") + 1].endswith("M")
    assert main(["train", "--steps", "1", "--batch", "2", "--seq", "32", "--eval-batches", "1", "--no-save",
                 *flags]) == 0


def machine(ram: int, nvme: int) -> Machine:
    return Machine(ram_total=ram, ram_available=ram, gpu=None, gpu_bytes=0, nvme_dir="/scratch", nvme_free=nvme)


def test_what_does_not_fit_is_named():
    units, _ = synthetic_unit_numels(13_000_000_000)
    kw = dict(dtype="bf16", state_dtype="fp32", world=1, prefetch_depth=2, sub_group_size=1 << 22, grad_clip=1.0,
              device="cpu", activations=0)
    roomy = verdict(units, {}, machine(1 << 50, 1 << 50), **kw)
    assert roomy.fits
    short = verdict(units, {}, machine(4 << 30, 10 << 30), **kw)
    assert not short.fits and (short.offload_params, short.offload_optimizer) == ("nvme", "nvme")
    assert any(s.startswith("NVMe: ") and "free in /scratch" in s for s in short.short)


def test_predict_without_a_placement_predicts_the_recommended_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    common = ["estimate", "--model", "tiny", "--predict", "--batch", "2", "--seq", "32", "--disk", fake_disk(tmp_path),
              "--flops", "1e11", "--adam-rate", "1e9", "--overhead", "0.01", "--json", "e.json"]
    assert main(common) == 0
    out = capsys.readouterr().out
    assert "predicting the recommended setting: ZeRO-3, parameters none, optimizer states none" in out
    got = json.load(open("e.json"))
    assert got["prediction"]["overhead"] == 0.01 and got["prediction"]["step"] >= 0.01
    assert main([*common, "--peak-flops", "1e9"]) == 0  # a peak below the rate measured
    out = capsys.readouterr().out
    assert "MFU not shown" in out and "MFU 1" not in out
    assert main([*common, "--stage", "3"]) == 2  # one of the three: ambiguous
    assert "give all of --stage" in capsys.readouterr().err


def test_device_defaults_to_what_the_machine_has(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    assert main(["estimate", "--model", "tiny", "--json", "e.json"]) == 0
    assert json.load(open("e.json"))["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
