"""Run under torchrun by test_frozen_in_place.py: two ranks train LoRA on a base each reads from
the weights files (its own half of every frozen unit), save a checkpoint that refers to the files,
then take two more steps; their losses are written for the test to compare with one rank resumed."""

import json
import os
import sys

import peft
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from hf_models import deferred, token_batches  # noqa: E402

import outcore  # noqa: E402


def lora_engine(directory: str, nvme: str) -> outcore.Engine:
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    config = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", grad_clip=1.0, nvme_dir=nvme)
    return outcore.Engine(peft.get_peft_model(deferred(directory), lora), config,
                          outcore.AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1), weights=directory)


def steps(engine: outcore.Engine, batches) -> list[float]:
    """Each rank takes its half of every batch: together they take the whole one."""
    losses = []
    for x in batches:
        half = x.shape[0] // engine.group.world
        mine = x[engine.group.rank * half : (engine.group.rank + 1) * half]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def main(directory: str, nvme: str, checkpoints: str, out: str) -> None:
    engine = lora_engine(directory, nvme)
    assert all(u.in_place is not None for u in engine.units if u.frozen)
    data = token_batches(4, batch=4)
    steps(engine, data[:2])
    engine.save_checkpoint(checkpoints, "step2")
    after = steps(engine, data[2:])
    state = engine.full_state_dict()
    if engine.group.rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": after, "lora": {k: v.tolist() for k, v in state.items() if "lora_" in k}}, f)
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
