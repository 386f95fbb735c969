"""The step prediction leaves out of `outcore tune` the candidates that cannot win, and says why."""

import dataclasses

import pytest

import outcore
from outcore.tools import step_estimate as se
from outcore.tools import tune as tune_module
from outcore.tools.model_source import resolve_model, source_layout
from outcore.tools.sweep_pruning import SweepPruner
from outcore.tools.tune import tune

GPU = se.Rates(disk_read=1e9, disk_write=1e9, flops=1e12, adam=1e9, host_device=25e9)
CPU = se.Rates(disk_read=1e6, disk_write=1e6, flops=1e10, adam=1e9, checksum=1e10)


def pruner(rates):
    units, layout = source_layout(resolve_model("tiny"))
    return SweepPruner(units, layout, tokens=2 * 128, rates=rates, device_type="cpu" if rates.cpu_only else "cuda",
                       available=8 << 30)


def nvme(host_budget):
    return outcore.Config(offload_params="nvme", offload_optimizer="nvme", nvme_dir="/unused",
                          device_budget=64 << 20, host_budget=host_budget)


def test_the_disk_settings_are_left_out_only_where_a_faster_disk_would_not_shorten_the_step():
    fast = pruner(dataclasses.replace(GPU, flops=1e10))
    why = fast.skip_io(nvme(8 << 20))
    assert why is not None and "bound by compute" in why
    assert fast.predict(nvme(8 << 20)).nvme_read > 0  # bytes move, and hide under compute
    slow = pruner(dataclasses.replace(GPU, disk_read=1e6, disk_write=1e6))
    assert slow.predict(nvme(8 << 20)).bound == "nvme" and slow.skip_io(nvme(8 << 20)) is None
    # on a CPU the I/O's own work shares the cores: always swept
    assert pruner(dataclasses.replace(CPU, disk_read=1e12, disk_write=1e12)).skip_io(nvme(8 << 20)) is None


def test_a_host_budget_refused_or_predicted_slower_is_left_out():
    p = pruner(GPU)
    best = nvme(64 << 20)
    refused = p.skip_host_budget(best, nvme(1 << 20))
    assert refused is not None and "smallest host budget the engine accepts" in refused
    with pytest.raises(ValueError, match="host_budget"):
        p.predict(nvme(1 << 20))  # as the engine refuses it
    slower = p.skip_host_budget(best, nvme(8 << 20))  # every shard read from NVMe again
    assert slower is not None and "slower beyond the prediction's 20% error" in slower
    assert p.predict(nvme(8 << 20)).step > 1.2 * p.predict(best).step
    assert p.skip_host_budget(best, nvme(32 << 20)) is None  # predicted as fast, in less memory


class Stub:
    """A pruner that leaves out the disk's settings and the smallest host budget."""

    def skip_io(self, config):
        return "the disk hides"

    def skip_host_budget(self, best, candidate):
        return "too small" if candidate.host_budget < best.host_budget // 2 else None


def test_the_sweep_runs_no_candidate_the_pruner_leaves_out(monkeypatch):
    ran = []

    def run(config, model_spec, **_):
        ran.append(config)
        return {"step_seconds": 1.0, "io_wait_seconds": 0.0, "peak_rss_bytes": 1 << 30, "bytes_read_per_step": 0,
                "bytes_written_per_step": 0, "loss": 1.0}

    monkeypatch.setattr(tune_module, "run_candidate", run)
    base = nvme(1 << 30)
    sweep = {"prefetch_depth": [1], "block_size": [1 << 20, 8 << 20], "queue_depth": [8], "threads": [2, 4],
             "nice": [0], "host_budget_fraction": [0.25, 0.5, 1.0]}
    tuned = tune(base, "tiny", sweep=sweep, rounds=1, pruner=Stub())
    assert {(c.io.block_size, c.io.queue_depth, c.io.threads) for c in ran} == {
        (base.io.block_size, base.io.queue_depth, base.io.threads)}  # the disk's settings as given only
    assert {c.host_budget for c in ran} == {1 << 30, 1 << 29}  # the quarter left out
    assert {c.prefetch_depth for c in ran} == {1, 2} and {c.io.nice for c in ran} == {0, 15}
    assert tuned.pruned == ["io: the disk hides", "threads: the disk hides", "host_budget=256.0 MiB: too small"]
