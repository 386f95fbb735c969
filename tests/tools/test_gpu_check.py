"""The GPU kit: exits 0 where there is no GPU, and its parity check is real (run here on the CPU)."""

import json

import pytest
import torch

from outcore.tools import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_cuda_it_says_so_and_exits_0(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
    assert json.loads(out.read_text())["cuda"] is False


def test_parity_compares_the_engine_with_plain_pytorch(tmp_path):
    rows = gpu_check.parity(torch.device("cpu"), str(tmp_path), steps=2,
                            settings=[(3, "nvme", "nvme"), (1, "none", "cpu")], dtypes=("fp32",))
    assert [r["ok"] for r in rows] == [True, True]
    assert all(r["worst_relative"] < 1e-5 and len(r["losses"]) == 2 for r in rows)


def test_the_largest_preset_that_fits():
    assert gpu_check.largest_fitting(128 << 30) == "gpt-3b"  # 3.1B x 18 B < 64 GiB < 6.6B x 18 B
    assert gpu_check.largest_fitting(16 << 30) == "gpt-350m"
    assert gpu_check.largest_fitting(1 << 30) == "tiny"
