"""Run under torchrun by test_unused_parameters.py: two ranks, each with half of every batch, where
only rank 0's half ever takes the branch; rank 0 saves the trained state."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from branch_models import BranchNet, batch  # noqa: E402
from test_unused_parameters import HP, TAKEN  # noqa: E402

import outcore  # noqa: E402


def main(out: str, nvme: str) -> None:
    torch.manual_seed(0)
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=nvme, grad_clip=None)
    engine = outcore.Engine(BranchNet(every_unit=True), cfg, outcore.AdamW(**HP))
    rank = engine.group.rank
    for i, taken in enumerate(TAKEN):
        engine.backward(engine(batch(i, taken, slice(2 * rank, 2 * rank + 2))))
        engine.step()
    state = engine.full_state_dict()
    if rank == 0:
        torch.save(state, out)
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
