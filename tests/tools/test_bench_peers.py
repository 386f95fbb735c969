"""`python -m outcore.tools.bench_peers`: each kind in its own process, medians in one table."""

import json

from outcore.tools import bench_peers


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
