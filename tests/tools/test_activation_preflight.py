"""Before the first step, a batch whose activations cannot fit in the memory the run may have is
refused, naming the largest batch that fits; that batch then runs."""

import re

import pytest

from outcore.tools.activations import Shape, activation_rows, preflight
from outcore.tools.cli import main

TINY = Shape(layers=4, d_model=128, vocab=256)


def test_activation_rows_grow_with_the_batch_and_checkpointing_keeps_less():
    full = activation_rows(TINY, batch=2, seq=64, dtype="fp32", checkpointed=False)
    kept = activation_rows(TINY, batch=2, seq=64, dtype="fp32", checkpointed=True)
    assert sum(kept.values()) < sum(full.values())
    assert sum(activation_rows(TINY, batch=4, seq=64, dtype="fp32", checkpointed=False).values()) == 2 * sum(
        full.values())
    assert full["logits, their fp32 loss and its gradient"] == 2 * 64 * 3 * 256 * 4


def test_preflight_names_the_largest_batch_that_fits():
    per_row = sum(activation_rows(TINY, batch=1, seq=64, dtype="fp32", checkpointed=False).values())
    with pytest.raises(ValueError, match=r"give --batch 10 or less, or use --checkpoint-activations"):
        preflight(TINY, batch=11, seq=64, dtype="fp32", checkpointed=False, budgets=0, max_memory=10 * per_row + 1)
    preflight(TINY, batch=10, seq=64, dtype="fp32", checkpointed=False, budgets=0, max_memory=10 * per_row + 1)


def test_a_batch_far_too_large_exits_2_before_the_first_step_and_the_batch_it_names_runs(tmp_path, capsys):
    args = ["train", "--seq", "128", "--steps", "1", "--max-memory", "1G", "--dtype", "fp32", "--offload-params",
            "nvme", "--offload-optimizer", "nvme", "--host-budget", "64M", "--out", str(tmp_path / "run")]
    assert main([*args, "--batch", "100000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--accumulate" in err[0], err
    fits = int(re.search(r"give --batch (\d+) or less", err[0]).group(1))
    assert 1 <= fits < 100000 and not (tmp_path / "run").exists()
    assert main([*args, "--batch", str(fits), "--no-save"]) == 0
