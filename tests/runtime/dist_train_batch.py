"""Run under torchrun by test_multirank.py: N ranks, each its slice of every micro-batch, one
train_batch of K micro-batches per step."""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from helpers import HP  # noqa: E402
from models import TinyGPT, batches  # noqa: E402

import outcore  # noqa: E402


def main(out_path: str, config_json: str, steps: int, k: int) -> None:
    torch.manual_seed(0)
    engine = outcore.Engine(TinyGPT(), outcore.Config.from_dict(json.loads(config_json)), outcore.AdamW(**HP))
    rank, world = engine.group.rank, engine.group.world
    part = slice(rank * 4 // world, (rank + 1) * 4 // world)
    data = batches(steps * k, batch=4)
    losses = []
    for s in range(steps):
        micro = [(x[part], y[part]) for x, y in data[s * k:(s + 1) * k]]
        mean = torch.tensor(engine.train_batch(micro)["losses"])
        dist.all_reduce(mean)
        losses.append(float(mean.mean()) / world)
    sd = engine.full_state_dict()
    if rank == 0:
        torch.save(sd, out_path + ".pt")
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "world": world}, f)
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
