"""Run by test_multirank.py, as one process or under torchrun: train on the ranks' slices of the same
global batches, from scratch (saving a checkpoint at the end) or resuming from one."""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from helpers import HP  # noqa: E402
from models import TinyGPT, batches  # noqa: E402

import outcore  # noqa: E402


def main(out_path: str, config_json: str, first: int, last: int, resume: str) -> None:
    torch.manual_seed(0)
    engine = outcore.Engine(TinyGPT(), outcore.Config.from_dict(json.loads(config_json)), outcore.AdamW(**HP))
    if resume:
        engine.load_checkpoint(resume)
    rank, world = engine.group.rank, engine.group.world
    losses = []
    for x, y in batches(last, batch=4)[first:last]:
        part = slice(rank * 4 // world, (rank + 1) * 4 // world)
        loss = engine(x[part], y[part])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
        losses.append(mean.item() / world)
    engine.save_checkpoint(out_path + ".ckpt", "end")
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "world": world}, f)
    engine.close()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
