"""The step prediction's arithmetic (tools/step_estimate.py), without running a model: FLOPs, the
bytes each tier moves, the time split and its bound from given rates, the accumulation that makes
compute the bound; and `outcore estimate --predict` on the tiny preset."""

import json
import subprocess
import sys

import pytest

from outcore.runtime.memory_plan import plan_memory, unit_shapes
from outcore.runtime.policy import StatePolicy
from outcore.tools.step_estimate import (
    Rates,
    StepShape,
    compute_bound_accumulation,
    predict_step,
    shape_of,
    step_bytes,
    step_flops,
)

GB = 1e9


def shape(**kw) -> StepShape:
    base = dict(params=1000, trained=1000, tokens=10, param_bytes=4000, state_bytes=8000)
    return StepShape(**{**base, **kw})


def test_flops_count_forward_backward_frozen_weights_and_recomputation():
    assert step_flops(shape()) == 6 * 1000 * 10
    assert step_flops(shape(trained=100)) == (4 * 1000 + 2 * 100) * 10  # no weight gradient where frozen
    assert step_flops(shape(checkpointing=True), accumulate=3) == 8 * 1000 * 10 * 3


def test_bytes_of_parameters_beyond_the_cache_and_of_streamed_states():
    s = shape(params_on_nvme=True, states_on_nvme=True, cache_bytes=3000, states_in_host=2000)
    # 1000 bytes of shards uncached: forward reads them, backward finds the last ones cached;
    # the trained ones are written once; 6000 bytes of states streamed each way
    assert step_bytes(s) == (1000 + 6000, 1000 + 6000, 0)
    small_cache = shape(params_on_nvme=True, cache_bytes=1000)  # 3000 uncached: backward reads 2000 more
    assert step_bytes(small_cache) == (3000 + 2000, 3000, 0)
    assert step_bytes(small_cache, accumulate=4)[0] == 4 * 5000  # every micro-step gathers again
    assert step_bytes(dataclass_replace(small_cache, vertical=True), accumulate=4)[0] == 5000  # one train_batch
    frozen = shape(trained=250, params_on_nvme=True, cache_bytes=0)
    assert step_bytes(frozen)[1] == 4000 // 4  # only what trains is written back


def test_an_accumulation_window_spills_the_gradients_the_cache_cannot_hold():
    s = shape(params_on_nvme=True, cache_bytes=5000, grad_bytes=4000)  # the shards fit, 3000 bytes of gradient not
    assert step_bytes(s) == (0, 0, 0)  # one micro-step: the update takes each gradient as it comes
    assert step_bytes(s, accumulate=3) == (3 * 3000, 3 * 3000, 0)
    assert step_bytes(dataclass_replace(s, vertical=True), accumulate=3) == (0, 0, 0)  # one backward pass


def test_on_a_cpu_the_checksums_of_what_the_swap_file_moves_take_the_cores_too():
    cpu = Rates(disk_read=GB, disk_write=GB, flops=60_000, adam=2000, checksum=8000)
    t = predict_step(shape(states_on_nvme=True), cpu)  # 8000 bytes each way
    assert t.step == pytest.approx(1.0 + 0.5 + 16000 / 8000)


def test_bytes_across_the_bus_on_a_gpu():
    s = shape(params_offloaded=True, optimizer_offloaded=True)
    assert step_bytes(s, accumulate=2)[2] == 2 * 2 * 4000 + 2 * 4 * 1000  # shards up each pass, fp32 grads down


def dataclass_replace(s, **kw):
    import dataclasses

    return dataclasses.replace(s, **kw)


GPU = Rates(disk_read=2 * GB, disk_write=1 * GB, flops=100e12, adam=1e9, host_device=20 * GB, peak_flops=200e12)


def test_a_gpu_step_overlapping_its_updates_is_the_longest_kind_of_work():
    s = StepShape(params=8_000_000_000, trained=8_000_000_000, tokens=4 * 2048, param_bytes=16 * 10**9,
                  state_bytes=96 * 10**9, states_on_nvme=True, optimizer_offloaded=True, params_offloaded=True)
    t = predict_step(s, GPU)
    assert t.compute == pytest.approx(6 * 8e9 * 8192 / 100e12)
    assert t.nvme == pytest.approx(96 / 2 + 96 / 1)
    assert t.optimizer == pytest.approx(8.0)
    assert t.host_device == pytest.approx((2 * 16e9 + 4 * 8e9) / 20e9)
    assert t.step == t.nvme and t.bound == "nvme"
    assert t.tokens_per_s == pytest.approx(8192 / t.step)
    assert t.mfu(200e12) == pytest.approx(t.flops / t.step / 200e12)
    # the states' bytes do not grow with accumulation, compute does: it bounds from 144/3.93 micro-batches up
    least = compute_bound_accumulation(s, GPU)
    assert least == 37
    assert predict_step(s, GPU, least).bound == "compute" and predict_step(s, GPU, least - 1).bound != "compute"


def test_updates_waiting_for_the_norm_come_after_compute():
    s = shape(optimizer_offloaded=True, updates_overlap=False)
    rates = Rates(disk_read=GB, disk_write=GB, flops=60_000, adam=1000, host_device=GB)
    t = predict_step(s, rates)
    assert t.step == pytest.approx(1.0 + 1.0) and t.bound == "compute"


def test_on_a_cpu_compute_and_updates_share_the_cores():
    cpu = Rates(disk_read=GB, disk_write=GB, flops=60_000, adam=2000)
    t = predict_step(shape(), cpu)
    assert t.step == pytest.approx(1.0 + 0.5) and t.bound == "compute"
    slow_disk = Rates(disk_read=1000, disk_write=1000, flops=60_000, adam=2000)
    t = predict_step(shape(states_on_nvme=True), slow_disk)
    assert t.step == pytest.approx(16.0) and t.bound == "nvme"


def test_on_a_cpu_a_base_read_in_place_takes_the_cores_too():
    """Its reads pass through the page cache, which the cores do; the swap file's direct reads do not."""
    base = dataclass_replace(shape(params_on_nvme=True), in_place_share=1.0)
    read = step_bytes(base)[0]
    assert read > 0
    cpu = Rates(disk_read=GB, disk_write=GB, flops=60_000, adam=2000, in_place_read=4000)
    t = predict_step(base, cpu)
    assert t.optimizer == pytest.approx(0.5 + read / 4000) and t.nvme == pytest.approx(step_bytes(base)[1] / GB)


def test_bytes_that_grow_with_every_micro_step_never_hide():
    s = shape(params_on_nvme=True, cache_bytes=0)  # 8000 bytes read a micro-step, at 1 KB/s: 8 s
    rates = Rates(disk_read=1000, disk_write=1e12, flops=60_000, adam=1e12, host_device=GB)
    assert compute_bound_accumulation(s, rates) is None
    # one train_batch gathers once: 8 s of reads and a write-back, hidden from 7 micro-batches of
    # 4/3 s of compute on (a train_batch recomputes each unit's forward)
    assert compute_bound_accumulation(dataclass_replace(s, vertical=True), rates) == 7


def test_the_shape_of_a_planned_model_caches_what_the_budgets_leave():
    numels = [1 << 20] * 4
    policy = StatePolicy(world=1, stage=3, offload_params="nvme", offload_optimizer="nvme", dtype="fp32",
                         device_type="cpu", prefetch_depth=2, sub_group_size=1 << 18, clipping=False)
    plan = plan_memory(unit_shapes(numels, policy), policy)
    roomy = shape_of(numels, [False] * 4, plan, policy, tokens=512, device_budget=64 << 20, host_budget=64 << 20)
    assert roomy.cache_bytes == roomy.param_bytes == 16 << 20 and roomy.state_bytes == plan.optimizer_states
    tight = shape_of(numels, [False] * 4, plan, policy, tokens=512, device_budget=plan.device_min,
                     host_budget=plan.host_min)
    assert tight.cache_bytes < tight.param_bytes
    assert step_bytes(tight)[0] > step_bytes(roomy)[0]


@pytest.mark.slow
def test_estimate_predict_on_the_tiny_preset(tmp_path):
    out = tmp_path / "estimate.json"
    cmd = [sys.executable, "-m", "outcore.tools.cli", "estimate", "--model", "tiny", "--stage", "3",
           "--offload-params", "nvme", "--offload-optimizer", "nvme", "--device", "cpu", "--dtype", "fp32",
           "--predict", "--batch", "2", "--seq", "64", "--nvme-dir", str(tmp_path), "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "predicted step" in res.stdout and "bound by" in res.stdout
    got = json.loads(out.read_text())["prediction"]
    assert got["step"] == pytest.approx(max(got["compute"] + got["optimizer"], got["nvme"]) + got["overhead"])
    assert got["overhead"] > 0 and got["rates"]["disk_read"] > 0 and got["tokens"] == 128
    assert not list(tmp_path.glob("outcore-bench-*"))  # the disk measurement leaves no file behind
    assert not list(tmp_path.glob(".outcore-overhead-*"))  # nor the overhead's engine
