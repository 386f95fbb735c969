"""Parameters that get no gradient in a step sit its update out, as torch.optim skips a parameter
whose `.grad` is None: no weight decay, no moment update, and their own step count (AdamW's bias
correction) falls behind the others'. Also a unit given a gradient in an earlier micro-step of an
accumulation window and not run in the last one: its norm is counted and its update applied."""

import copy
import os
import subprocess

import pytest
import torch
from branch_models import BranchNet, batch
from launch import torchrun
from test_multirank import HERE

import outcore

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# Micro-batches that take the branch: steps (and, accumulating 2, a window) without it, and
# windows in which an earlier micro-batch took it and the last did not.
TAKEN = [True, False, False, False, False, True, True, False]


def config(tmp_path, name="nvme", **kw):
    return outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / name),
                          **kw)


def plain(model, accum, clip, micro=TAKEN):
    opt = torch.optim.AdamW(model.parameters(), **HP)
    for start in range(0, len(micro), accum):
        for i in range(start, start + accum):
            (model(batch(i, micro[i])) / accum).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def run(engine, micro=TAKEN, first=0):
    for i in range(first, first + len(micro)):
        engine.backward(engine(batch(i, micro[i - first])))
        engine.step()


def assert_same(engine, model):
    state = engine.full_state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("accum", [1, 2, 4])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["overlapped", "clipped"])
def test_parameters_without_a_gradient_sit_out_as_torch_skips_them(tmp_path, accum, clip):
    torch.manual_seed(0)
    ours, ref = BranchNet(), BranchNet()
    ref.load_state_dict(ours.state_dict())
    opt = plain(ref, accum, clip)
    if accum < 4:  # it sat some updates out
        assert opt.state[ref.gate.weight]["step"] < opt.state[ref.head.weight]["step"]
    engine = outcore.Engine(ours, config(tmp_path, grad_accumulation=accum, grad_clip=clip), outcore.AdamW(**HP))
    run(engine)
    assert_same(engine, ref)
    engine.close()


def test_a_resumed_run_keeps_each_parameters_step_count(tmp_path):
    torch.manual_seed(0)
    model = BranchNet()
    whole = outcore.Engine(copy.deepcopy(model), config(tmp_path, "a", grad_clip=None), outcore.AdamW(**HP))
    run(whole)
    first = outcore.Engine(copy.deepcopy(model), config(tmp_path, "b", grad_clip=None), outcore.AdamW(**HP))
    run(first, TAKEN[:3])  # the gate has sat out two updates of three
    first.save_checkpoint(str(tmp_path / "ckpt"))
    first.close()
    resumed = outcore.Engine(copy.deepcopy(model), config(tmp_path, "c", grad_clip=None), outcore.AdamW(**HP))
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    run(resumed, TAKEN[3:], first=3)
    expected, got = whole.full_state_dict(), resumed.full_state_dict()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    whole.close()
    resumed.close()


@pytest.mark.slow
def test_two_ranks_update_a_parameter_only_one_of_them_gave_a_gradient(tmp_path):
    """Rank 0's rows take the branch, rank 1's never do: the gate is updated on both, as on one rank
    over the global batch, and sits out only the steps in which no rank took it. (Every rank runs
    every unit: block 1 runs on rank 1 too, on no rows, as FSDP and DeepSpeed also require.)"""
    out = str(tmp_path / "two.pt")
    cmd = [*torchrun(2, tmp_path), os.path.join(HERE, "dist_branch.py"), out, str(tmp_path / "nvme2")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    torch.manual_seed(0)
    ref = BranchNet(every_unit=True)
    plain(ref, 1, None)
    two = torch.load(out, weights_only=True)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(two[name], value, rtol=1e-4, atol=1e-4, msg=name)
