"""`python -m outcore.tools.kit.bench_engine step`: each kind in its own process, under the budgets asked for."""

import importlib
import json

import pytest

from outcore.tools.kit import bench_engine


def _step(tmp_path, budget: str, kinds: str = "plain,nvme-noclip") -> list[dict]:
    out = tmp_path / f"step-{budget}.json"
    assert bench_engine.main(["step", "--preset", "tiny", "--batch", "1", "--steps", "2",
                              "--kinds", kinds, "--budget", budget, "--no-fio",
                              "--dir", str(tmp_path / "nvme"), "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_step_against_plain_under_given_or_derived_budgets(tmp_path, capsys):
    plain, tight = _step(tmp_path, "8M")
    assert "NVMe-run budgets 8.0 MiB;" in capsys.readouterr().out
    (derived,) = _step(tmp_path, "derived", kinds="nvme-noclip")  # plain once is enough
    assert "NVMe-run budgets derived;" in capsys.readouterr().out
    assert (plain["kind"], tight["kind"], derived["kind"]) == ("plain", "nvme-noclip", "nvme-noclip")
    assert plain["step_s"] > 0 and tight["step_s"] > 0 and derived["step_s"] > 0
    # The derived budgets hold what 8 MiB each cannot, so a step reads less from the disk.
    assert tight["read_bytes_per_step"] > derived["read_bytes_per_step"]
    assert not list((tmp_path / "nvme").iterdir())  # the runs' swap folders are gone


@pytest.mark.parametrize("tool, argv", [
    ("bench_engine", ["step", "--preset", "tiny", "--steps", "1", "--rounds", "1"]),
    ("bench_engine", ["optimizer"]),
    ("bench_peers", ["--preset", "tiny", "--steps", "1", "--rounds", "1"]),
    ("soak", ["--steps", "1"]),
    ("gpu_check", []),
])
def test_a_json_that_cannot_be_written_stops_a_benchmark_before_it_runs(tmp_path, monkeypatch, capsys, tool, argv):
    """Before, the rounds ran for minutes (a soak for hours) and the result was lost at the end."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").mkdir()
    module = importlib.import_module(f"outcore.tools.kit.{tool}")
    with pytest.raises(SystemExit) as e:
        module.main([*argv, "--json", "taken"])
    assert e.value.code == 2 and "--json" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]


@pytest.mark.slow
def test_the_store_alone_evicts_writes_back_and_reads_again_and_leaves_nothing(tmp_path, capsys):
    (tmp_path / "nvme").mkdir()
    result = bench_engine.run_store(str(tmp_path / "nvme"), keys=16, rounds=4)
    assert result["seconds"] > 0 and result["fetches"] == 32
    assert result["writebacks"] > 0 and result["bytes_read"] >= 16 << 20  # keys evicted, written and read back
    assert bench_engine.main(["store", "--dir", str(tmp_path / "nvme"), "--repeats", "1"]) == 0
    assert "320 fetches changed and written back" in capsys.readouterr().out
    assert not list((tmp_path / "nvme").iterdir())  # the swap folders are gone
