"""Run under torchrun by test_quantized.py: two ranks train LoRA on a base stored NF4 in the tiers
(each rank its shard of every quantized unit's bytes), each on its half of every batch; rank 0
writes the losses and the adapters for the test to compare with one rank on whole batches."""

import json
import os
import sys

import peft
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from dist_in_place_checkpoint import steps  # noqa: E402  (each rank its half of every batch)
from hf_models import deferred, token_batches  # noqa: E402

import outcore  # noqa: E402


def qlora_engine(directory: str, nvme: str) -> outcore.Engine:
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    config = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", grad_clip=1.0, nvme_dir=nvme,
                            quantize="nf4", quantize_double=True)
    return outcore.Engine(peft.get_peft_model(deferred(directory), lora), config,
                          outcore.AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1), weights=directory)


def main(directory: str, nvme: str, out: str) -> None:
    engine = qlora_engine(directory, nvme)
    assert any(u.quantized is not None for u in engine.units)
    losses = steps(engine, token_batches(3, batch=4))
    state = engine.full_state_dict()
    if engine.group.rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "lora": {k: v.tolist() for k, v in state.items() if "lora_" in k}}, f)
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
