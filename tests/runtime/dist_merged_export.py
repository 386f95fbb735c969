"""Run under torchrun by test_merged_export.py: two ranks export a LoRA model merged, each holding
half of every unit. With an initialization computed from the weights (`pissa`, trainable tokens),
each rank computes it from the whole weight as its unit is materialized."""

import os
import sys

import peft
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(__file__))
from hf_models import deferred  # noqa: E402

import outcore  # noqa: E402


def main(directory: str, out: str, nvme: str, init: str) -> None:
    if init == "false":  # B not zero; wrapped after the block, as README shows
        model = peft.get_peft_model(deferred(directory), lora_config(init))
    else:
        with outcore.deferred_init():
            model = peft.get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory)),
                                        lora_config(init))
    engine = outcore.Engine(model,
                            outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=nvme),
                            weights=directory)
    state = engine.full_state_dict()
    engine.export(out, merge_adapters=True)
    if engine.group.rank == 0:
        torch.save(state, out + ".pt")
    engine.close()
    dist.destroy_process_group()


def lora_config(init: str) -> peft.LoraConfig:
    """"false": A and B as linear layers (B not zero); "tokens": peft's default with trainable tokens
    of the embedding; else `init_lora_weights=init`."""
    if init == "tokens":
        return peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"],
                               trainable_token_indices={"embed_tokens": [3, 5, 9]})
    return peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"],
                           init_lora_weights=False if init == "false" else init)


if __name__ == "__main__":
    main(*sys.argv[1:5])
