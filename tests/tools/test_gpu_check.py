"""The GPU kit: exits 0 where there is no GPU, and its parity check is real (run here on the CPU)."""

import json
import shutil
import subprocess

import pytest
import torch

from outcore.tools.kit import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_cuda_it_says_so_and_exits_0(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--json", str(out)]) == 0  # --json, as every outcore tool names it
    assert "no CUDA GPU" in capsys.readouterr().out
    assert json.loads(out.read_text())["cuda"] is False


def test_parity_compares_the_engine_with_plain_pytorch(tmp_path):
    rows = gpu_check.parity(torch.device("cpu"), str(tmp_path), steps=2,
                            settings=[(3, "nvme", "nvme"), (1, "none", "cpu")], dtypes=("fp32",))
    assert [r["ok"] for r in rows] == [True, True]
    assert all(r["worst_relative"] < 1e-5 and len(r["losses"]) == 2 for r in rows)


def test_the_throughput_run_trains_through_nvme_and_counts_its_tokens(tmp_path):
    """The part of the kit a GPU runs longest, run here on the CPU with the smallest preset."""
    got = gpu_check.throughput(torch.device("cpu"), "tiny", str(tmp_path), offload="nvme", steps=2, batch=2,
                               peak=1e12)
    assert got["preset"] == "tiny" and got["offload"] == "nvme" and got["gpu_peak_allocated_bytes"] is None
    assert got["tokens_per_s"] == pytest.approx(2 * got["seq"] / got["step_s"])
    assert got["MFU"] == pytest.approx(got["model_TFLOPS"] * 1e12 / 1e12)
    assert got["bytes_read"] > got["params"] * 2  # the parameters and optimizer states came from the swap file
    assert got["bytes_written"] > got["params"] * 12 and got["io_busy_seconds"] > 0  # the update went back to it
    assert list(tmp_path.iterdir()) == []  # its swap files went with it


def test_the_disk_part_measures_the_swap_directory_with_the_stores_settings(tmp_path):
    got = gpu_check.disk(str(tmp_path), size=8 << 20)
    assert got["bytes"] == 8 << 20 and got["write_GBps"] > 0 and got["read_GBps"] > 0
    assert (got["fio_read_GBps"] is None) == (shutil.which("fio") is None)
    assert list(tmp_path.iterdir()) == []  # its file went with it


def test_the_largest_preset_that_fits():
    assert gpu_check.largest_fitting(128 << 30) == "gpt-3b"  # 3.1B x 18 B < 64 GiB < 6.6B x 18 B
    assert gpu_check.largest_fitting(16 << 30) == "gpt-350m"
    assert gpu_check.largest_fitting(1 << 30) == "tiny"


def test_a_part_that_fails_is_recorded_and_the_kit_goes_on(tmp_path, monkeypatch):
    """The first run on a GPU is when things break: each part's error lands in the JSON (written
    after every part), the others still run, and the exit status says so."""
    out = tmp_path / "gpu.json"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a stand-in GPU")
    monkeypatch.setattr(gpu_check, "run_cuda_tests", lambda: {"ran": True, "ok": True, "summary": "8 passed"})

    def parity(device, nvme_dir):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu_check, "parity", parity)
    monkeypatch.setattr(gpu_check, "copy_overlap", lambda device: {"ok": True, "copy_GBps": 25.0, "overlap": 0.9})
    monkeypatch.setattr(gpu_check, "matmul_peak", lambda device: 900e12)
    monkeypatch.setattr(gpu_check, "disk", lambda nvme_dir: {"write_GBps": 2.0, "read_GBps": 3.0})
    seen = []

    def throughput(device, preset, nvme_dir, **kw):
        seen.append(preset)
        if preset == "gpt-1b":
            raise MemoryError("the stand-in ran out")
        return {"params": 3e9, "tokens_per_s": 1000.0, "model_TFLOPS": 100.0, "MFU": 0.11,
                "gpu_peak_allocated_bytes": 1}

    monkeypatch.setattr(gpu_check, "throughput", throughput)
    monkeypatch.setattr(gpu_check, "largest_fitting", lambda memory: "gpt-3b")

    def shape_row(row, nvme_dir, *, peak, disk, overlap):
        assert peak == 900e12 and disk["read_GBps"] == 3.0 and overlap["copy_GBps"] == 25.0  # the kit's rates
        if row == "qwen-14b-lora":
            raise RuntimeError("qwen-14b-lora failed: out of NVMe")
        return {"row": row, "accumulate": 8, "batch": 1, "seq": 2048, "tokens_per_s": 5000.0, "MFU": 0.3,
                "peak_host_rss_bytes": 1 << 30, "bytes_read_per_step": 0,
                "predicted": {"tokens_per_s": 5500.0, "bound": "compute"}}

    monkeypatch.setattr(gpu_check, "shape_row", shape_row)
    assert gpu_check.main(["--out", str(out), "--nvme-dir", str(tmp_path / "nvme")]) == 1
    got = json.loads(out.read_text())
    assert got["cuda_tests"]["ok"] and got["overlap"]["ok"] and got["ok"] is False
    assert set(got["errors"]) == {"parity", "gpt-1b", "qwen-14b-lora"}
    assert "illegal memory access" in got["errors"]["parity"]["error"]
    assert "MemoryError" in got["errors"]["gpt-1b"]["traceback"]
    assert seen == ["gpt-1b", "gpt-3b"] and list(got["throughput"]) == ["gpt-3b"]
    assert got["shapes"]["llama-8b-full"]["accumulate"] == 8 and "qwen-14b-lora" not in got["shapes"]
    assert got["shapes"]["deepspeed_zero3"].startswith("not run: ")


def test_cuda_tests_that_hang_are_a_failed_part_not_a_lost_run(monkeypatch):
    def hang(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"], output=b"tests/offload/test_cuda_paths.py ..")

    monkeypatch.setattr(subprocess, "run", hang)
    got = gpu_check.run_cuda_tests()
    assert got["ok"] is False and "timed out" in got["summary"] and "test_cuda_paths" in got["output_tail"]
