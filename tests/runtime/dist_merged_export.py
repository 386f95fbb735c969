"""Run under torchrun by test_merged_export.py: two ranks export a LoRA model merged, each holding
half of every unit."""

import os
import sys

import peft
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from hf_models import deferred  # noqa: E402

import outcore  # noqa: E402


def main(directory: str, out: str, nvme: str) -> None:
    lora = peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"], init_lora_weights=False)  # B not zero
    engine = outcore.Engine(peft.get_peft_model(deferred(directory), lora),
                            outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=nvme),
                            weights=directory)
    state = engine.full_state_dict()
    engine.export(out, merge_adapters=True)
    if engine.group.rank == 0:
        torch.save(state, out + ".pt")
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
