"""Run under torchrun by test_task_head.py: two ranks put a classification head on a causal LM's
files; each draws the new head for the half it holds, and rank 0 saves what the two hold together."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from test_task_head import classifier  # noqa: E402

import outcore  # noqa: E402


def main(directory: str, out: str, nvme: str) -> None:
    engine = outcore.Engine(classifier(directory), outcore.Config(stage=3, offload_params="nvme", nvme_dir=nvme),
                            weights=directory)
    state = engine.full_state_dict()
    if engine.group.rank == 0:
        torch.save(state, out)
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
