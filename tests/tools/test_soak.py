"""The soak benchmark: its fitted trend, a short run on NVMe, and what it leaves behind (nothing)."""

import os

import pytest

from outcore.tools.kit.soak import main, soak, trend


def test_the_trend_is_fitted_after_the_warm_up():
    steps = list(range(5, 100, 10))  # the first 10% of 95 steps is warm-up: the sample at step 5
    values = [5000] + [500 + 2 * s for s in steps[1:]]
    t = trend(steps, values)
    assert t["samples"] == 9 and t["slope_per_step"] == pytest.approx(2.0)
    assert t["rise"] == pytest.approx(2.0 * 80) and (t["first"], t["last"], t["max"]) == (530, 690, 690)


def test_a_short_soak_reads_and_writes_nvme_and_leaves_no_scratch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    said: list[str] = []
    res = soak(steps=12, preset="tiny", seq=16, batch=1, offload="nvme", host_budget=8 << 20, samples=6,
               nvme_dir=None, report=said.append)
    assert res["samples"]["step"] == [2, 4, 6, 8, 10, 12] and len(res["samples"]["rss"]) == 6
    assert res["bytes_read_per_step"] > 0 and res["bytes_written_per_step"] > 0
    assert min(res["samples"]["swap"]) > 0 and "swap file" in said[-1]
    assert os.listdir(tmp_path) == []


def test_a_budget_the_engine_refuses_is_one_line_and_leaves_no_scratch(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["--steps", "5", "--host-budget", "4K"])
    assert e.value.code == 2
    assert "error: host_budget=4,096 bytes cannot hold" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
