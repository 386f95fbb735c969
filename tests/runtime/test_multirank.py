"""Two real ranks under torchrun (gloo) train exactly like one rank on the whole batch."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import assert_losses_match, train_plain, twins
from launch import torchrun
from models import TinyGPT, batches
from safetensors.torch import load_file

from outcore.tools.export import export_checkpoint

HERE = os.path.dirname(__file__)


@pytest.mark.slow
@pytest.mark.parametrize("stage, params, optim, clip, chunk, compiled", [(3, "nvme", "nvme", 1.0, 1024, False),
                                                                         (3, "cpu", "none", None, 1 << 22, False),
                                                                         (2, "none", "nvme", 1.0, 2048, False),
                                                                         (3, "nvme", "nvme", None, 1024, True),
                                                                         # clipping that never clips: every
                                                                         # update speculated and kept
                                                                         (3, "cpu", "nvme", 100.0, 1024, False)])
def test_two_ranks_equal_one_rank_on_the_global_batch(tmp_path, stage, params, optim, clip, chunk, compiled):
    out = str(tmp_path / "result.json")
    cfg = {"stage": stage, "offload_params": params, "offload_optimizer": optim, "nvme_dir": str(tmp_path / "nvme"),
           "grad_clip": clip, "sub_group_size": chunk}
    cmd = [*torchrun(2, tmp_path), os.path.join(HERE, "dist_train.py"), out, json.dumps(cfg), "12"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"COMPILE_BACKEND": "aot_eager"} if compiled else {})}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.load(open(out))
    assert got["world"] == 2 and got["swap_files"] == ["rank0.swap", "rank1.swap"]
    assert got["between_steps"] == ("refused" if stage == 3 else "read")
    # speculative clipping (ZeRO-3, optimizer on NVMe): the clip at 1.0 makes the first step redo its
    # speculation and the next ones wait; at 100 every step's speculation stands
    # (units whose states the host budget keeps wait for the norm)
    n = got["states_on_nvme"] if stage == 3 and optim == "nvme" else 0
    assert got["speculative_updates"] == {"kept": 12 * n if clip == 100.0 else 0, "redone": n if clip == 1.0 else 0,
                                          "taken_back": 0, "waited": 0}
    assert n >= 2 or stage < 3 or optim != "nvme"
    _, ref_model = twins(TinyGPT)
    ref = train_plain(ref_model, batches(12, batch=4), clip=clip)
    assert_losses_match(got["losses"], ref, rel=1e-5)
    sd = torch.load(out + ".pt", weights_only=True)
    for k, v in ref_model.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-4, atol=1e-5, msg=k)
    # `outcore export` rebuilds the same tensors from the two rank files alone, without the model.
    exported = load_file(export_checkpoint(out + ".ckpt", str(tmp_path / "model.safetensors"))["out"])
    assert list(exported) == list(sd)
    for k, v in sd.items():
        assert torch.equal(exported[k], v), k


@pytest.mark.slow
def test_two_ranks_with_bf16_states_train_as_fp32_states_do(tmp_path):
    """Each rank rounds its own shard's states with its own generator; the run stays within bf16's
    rounding of the fp32 one, and its checkpoint exports."""
    out = str(tmp_path / "result.json")
    cfg = {"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_dir": str(tmp_path / "nvme"),
           "state_dtype": "bf16", "sub_group_size": 1024}
    cmd = [*torchrun(2, tmp_path), os.path.join(HERE, "dist_train.py"), out, json.dumps(cfg), "12"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.load(open(out))
    _, ref_model = twins(TinyGPT)
    ref = train_plain(ref_model, batches(12, batch=4), clip=1.0)
    assert got["losses"] != ref
    assert_losses_match(got["losses"], ref, rel=2e-3)
    exported = load_file(export_checkpoint(out + ".ckpt", str(tmp_path / "model.safetensors"))["out"])
    assert exported.keys() == ref_model.state_dict().keys()


def run_ranks(world: int, tmp_path, name: str, cfg: dict, first: int, last: int, resume: str = "") -> dict:
    out = str(tmp_path / name)
    script = [os.path.join(HERE, "reshard_train.py"), out, json.dumps(cfg), str(first), str(last), resume]
    if world > 1:
        cmd = [*torchrun(world, tmp_path), *script]
    else:
        cmd = [sys.executable, *script]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.load(open(out))
    assert got["world"] == world
    return got


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_checkpoint_written_by_n_ranks_resumes_on_m_exactly(tmp_path, before, after):
    cfg = {"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_dir": str(tmp_path / "nvme"),
           "grad_clip": 1.0, "sub_group_size": 1024}
    whole = run_ranks(1, tmp_path, "whole", cfg, 0, 10)
    first = run_ranks(before, tmp_path, "first", cfg, 0, 5)
    second = run_ranks(after, tmp_path, "second", cfg, 5, 10, resume=str(tmp_path / "first.ckpt"))
    assert_losses_match(first["losses"] + second["losses"], whole["losses"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("stage, params, optim, dtype", [(3, "nvme", "nvme", "fp32"), (2, "none", "cpu", "fp32"),
                                                         (3, "nvme", "nvme", "bf16")])
def test_two_ranks_train_batch_equals_one_rank_accumulating_the_global_batch(tmp_path, stage, params, optim, dtype):
    """In bf16 each micro-batch's gradient is its own reduce-scatter (runtime/vertical.py): the ranks
    run them in the same order, and train as plain PyTorch does to bf16's precision."""
    out = str(tmp_path / "result.json")
    cfg = {"stage": stage, "offload_params": params, "offload_optimizer": optim, "nvme_dir": str(tmp_path / "nvme"),
           "grad_clip": 1.0, "sub_group_size": 1024, "dtype": dtype}
    cmd = [*torchrun(2, tmp_path), os.path.join(HERE, "dist_train_batch.py"), out, json.dumps(cfg), "3", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.load(open(out))
    _, ref_model = twins(TinyGPT)
    ref = train_plain(ref_model, batches(6, batch=4), clip=1.0, accum=2)
    tol = 1e-5 if dtype == "fp32" else 2e-2
    assert_losses_match(got["losses"], ref, rel=tol)
    sd = torch.load(out + ".pt", weights_only=True)
    for k, v in ref_model.state_dict().items():
        torch.testing.assert_close(sd[k].float(), v, rtol=10 * tol, atol=tol, msg=k)
