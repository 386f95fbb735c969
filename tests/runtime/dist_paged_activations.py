"""Run under torchrun by test_paged_activations.py: N ranks train a checkpointed GPT with their
saved activations paged as the config says, through `engine(...)` + `backward` ("plain") or one
`train_batch` a step ("batch"); rank 0 writes the losses, the weights and the paged bytes."""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from helpers import HP  # noqa: E402
from models import TinyGPT, batches  # noqa: E402

import outcore  # noqa: E402
from outcore.runtime import saved_activations  # noqa: E402

saved_activations.PAGED_BYTES = 1 << 10  # the small model's activations page too


def main(out_path: str, config_json: str, path: str) -> None:
    torch.manual_seed(0)
    engine = outcore.Engine(TinyGPT(checkpointing=True), outcore.Config.from_dict(json.loads(config_json)),
                            outcore.AdamW(**HP))
    rank, world = engine.group.rank, engine.group.world
    part = slice(rank * 4 // world, (rank + 1) * 4 // world)
    data = [(x[part], y[part]) for x, y in batches(6, batch=4)]
    losses, paged = [], []
    for s in range(3):
        micro = data[2 * s:2 * s + 2]
        if path == "batch":
            losses += engine.train_batch(micro)["losses"]
        else:
            for x, y in micro:
                loss = engine(x, y)
                engine.backward(loss)
                losses.append(float(loss.detach()))
            engine.step()
        paged.append(engine.stats()["activations"])
    left = [k for k in engine.store.keys() if k.startswith("act.")]
    sd = engine.full_state_dict()
    if rank == 0:
        torch.save(sd, out_path + ".pt")
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "paged": paged, "left": left, "world": world}, f)
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
