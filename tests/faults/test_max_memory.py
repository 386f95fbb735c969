"""Round 3: `--max-memory` bounds the whole run, the store's budgets included (derived or given):
the offload setting and a derived host budget are chosen to fit, the arithmetic is in --json, and a
run that cannot fit is refused before step 1."""

import json
import subprocess
import sys

import pytest

from outcore.tools.cli import main


@pytest.mark.slow
def test_a_derived_budget_is_lowered_to_fit_and_the_peak_stays_under_max_memory(tmp_path):
    bound = 1200 << 20
    done = subprocess.run([sys.executable, "-m", "outcore.tools.cli", "train", "--preset", "gpt-125m", "--batch", "1",
                           "--seq", "32", "--steps", "1", "--eval-batches", "1", "--no-save", "--max-memory", "1200M",
                           "--out", str(tmp_path / "run"), "--json", str(tmp_path / "s.json")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    assert (s["offload_params"], s["offload_optimizer"]) == ("nvme", "nvme")  # its 1.8 GiB of states do not fit
    memory = s["memory"]
    assert memory["max_memory"] == bound and memory["total"] <= bound
    assert memory["total"] == sum(memory[k] for k in ("process", "device_budget_in_ram", "host_budget", "activations",
                                                     "slack"))
    assert s["config"]["host_budget"] == memory["host_budget"]  # lowered from the derived one, and said
    assert "to fit --max-memory" in done.stdout
    assert s["peak_rss_bytes"] <= bound


def test_a_run_that_cannot_fit_is_refused_before_step_1_with_its_arithmetic(tmp_path, capsys):
    assert main(["train", "--preset", "gpt-125m", "--batch", "1", "--seq", "32", "--steps", "1", "--max-memory",
                 "500M", "--out", str(tmp_path / "run")]) == 2
    said = capsys.readouterr()
    assert "cannot hold this run: this process" in said.err and "host budget" in said.err
    assert "step 1" not in said.out


@pytest.mark.slow
def test_a_run_starved_by_ulimit_v_says_so_and_what_to_do(tmp_path):
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (1_150_000_000, resource.RLIM_INFINITY))

    done = subprocess.run([sys.executable, "-m", "outcore.tools.cli", "train", "--steps", "1", "--no-save", "--out",
                           str(tmp_path / "run")], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          preexec_fn=limit)
    assert done.returncode != 0
    # said before the run starts (a thread library may abort the process, past any handler), and with
    # the failure where Python sees it
    assert "(ulimit -v)" in done.stdout and "--max-memory" in done.stdout and "Traceback" not in done.stderr
