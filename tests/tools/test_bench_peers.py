"""`python -m outcore.tools.kit.bench_peers`: each kind in its own process, medians in one table."""

import json

import pytest

from outcore.tools.kit import bench_peers


@pytest.mark.slow
def test_plain_and_outcore_side_by_side(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_peers, "deepspeed_available", lambda: False)
    out = tmp_path / "peers.json"
    assert bench_peers.main(["--preset", "tiny", "--batch", "1", "--steps", "1", "--rounds", "2",
                             "--dir", str(tmp_path / "nvme"), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "deepspeed is not importable" in printed and "disk read/step" in printed
    per_round = [line for line in printed.splitlines() if "round by round" in line]
    assert len(per_round) == 1 and per_round[0].startswith("  outcore / plain")
    results = json.loads(out.read_text())["results"]
    assert [r["kind"] for r in results] == ["plain", "outcore"] * 2
    ratios = [f"{results[i + 1]['step_s'] / results[i]['step_s']:.2f}" for i in (0, 2)]
    assert per_round[0].split(": ")[1].split() == ratios
    assert all(r["step_s"] > 0 and r["peak_rss"] > 0 for r in results)
    assert results[1]["disk_written_per_step"] > 0  # outcore's states went to the disk


def test_deepspeed_offloads_both_states_where_its_kind_says():
    on_disk = bench_peers.deepspeed_config(2, "nvme", "/swap")["zero_optimization"]
    in_memory = bench_peers.deepspeed_config(2, "cpu", "/swap")["zero_optimization"]
    assert on_disk["stage"] == in_memory["stage"] == 3
    for key in ("offload_param", "offload_optimizer"):
        assert on_disk[key] == {"device": "nvme", "nvme_path": "/swap"}
        assert in_memory[key] == {"device": "cpu"}  # no path: nothing of DeepSpeed's touches the disk


@pytest.mark.slow
def test_every_deepspeed_kind_is_left_out_by_name_without_deepspeed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_peers, "deepspeed_available", lambda: False)
    assert bench_peers.main(["--preset", "tiny", "--batch", "1", "--steps", "1", "--rounds", "1",
                             "--dir", str(tmp_path / "nvme"), "--kinds", "plain,deepspeed,deepspeed-cpu"]) == 0
    printed = capsys.readouterr().out
    assert "deepspeed, deepspeed-cpu left out" in printed
    assert "round 1/1 plain" in printed and "round 1/1 deepspeed" not in printed
