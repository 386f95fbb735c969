"""Run under torchrun by test_multirank.py: N ranks train on their slices of the same global batches."""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from helpers import HP  # noqa: E402
from models import TinyGPT, batches  # noqa: E402

import outcore  # noqa: E402
from outcore.offload import Tier  # noqa: E402
from outcore.runtime.released import ReleasedParameterError  # noqa: E402


def main(out_path: str, config_json: str, steps: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    cfg = outcore.Config.from_dict(json.loads(config_json))
    engine = outcore.Engine(model, cfg, outcore.AdamW(**HP))
    if os.environ.get("COMPILE_BACKEND"):  # torch.compile in place: the hooks, and so the collectives, run eagerly
        model.compile(backend=os.environ["COMPILE_BACKEND"])
    rank, world = engine.group.rank, engine.group.world
    losses = []
    for x, y in batches(steps, batch=4):
        part = slice(rank * 4 // world, (rank + 1) * 4 // world)
        loss = engine(x[part], y[part])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    try:  # a released unit's parameter, read between steps (ZeRO-3: refused with a clear error)
        float(model.blocks[0].ln1.weight.sum())
        between_steps = "read"
    except ReleasedParameterError:
        between_steps = "refused"
    swap_files = sorted(f for f in os.listdir(cfg.nvme_dir) if f.endswith(".swap"))
    sd = engine.full_state_dict()
    engine.save_checkpoint(out_path + ".ckpt", "final")  # for the offline export check
    if rank == 0:
        torch.save(sd, out_path + ".pt")
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "world": world, "swap_files": swap_files, "between_steps": between_steps,
                       "speculative_updates": engine.stats()["speculative_updates"],
                       "states_on_nvme": sum(1 for u in engine.units
                                             if u.chunks and engine.place.opt_home(u.index) == Tier.NVME)}, f)
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
