"""Fine-tune a causal LM with LoRA through TRL's SFTTrainer, on outcore: the script you already have,
with one change (the class), and outcore's config for where the states live.

    python examples/sft_trainer.py --model /models/llama-8b --data chats.jsonl --out run --nvme-dir /mnt/nvme/run

`--data` is a JSONL file of {"messages": [{"role": ..., "content": ...}, ...]} rows (or any format
SFTTrainer reads); the model directory holds config.json, the weights and a tokenizer with a chat
template. The model is never loaded whole: outcore builds it without memory and streams its weights
into the tiers, so it may be larger than this machine's GPU and host memory.
"""

import argparse

import datasets
import peft
import trl

import outcore
from outcore.hf import outcore_trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a Hugging Face model directory")
    p.add_argument("--data", required=True, help="a JSONL file of conversations")
    p.add_argument("--out", default="sft-run", help="checkpoints, logs and the adapters")
    p.add_argument("--nvme-dir", required=True, help="where outcore pages parameters and optimizer states")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lora", type=int, default=16, help="the adapters' rank")
    a = p.parse_args()

    train = datasets.load_dataset("json", data_files=a.data, split="train")
    args = trl.SFTConfig(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, learning_rate=2e-4, lr_scheduler_type="cosine",
                         warmup_steps=2, logging_steps=1, save_steps=10, save_total_limit=2,
                         assistant_only_loss=True, max_length=512, report_to=[], bf16=False)
    SFTTrainer = outcore_trainer(trl.SFTTrainer)  # the one change: trl.SFTTrainer -> outcore_trainer(trl.SFTTrainer)
    trainer = SFTTrainer(model=a.model, args=args, train_dataset=train,
                         peft_config=peft.LoraConfig(r=a.lora, lora_alpha=2 * a.lora, target_modules="all-linear"),
                         outcore_config=outcore.Config(offload_params="nvme", offload_optimizer="nvme",
                                                       nvme_dir=a.nvme_dir))
    trainer.train()
    trainer.save_model()  # adapter_model.safetensors + adapter_config.json + the tokenizer, in --out


if __name__ == "__main__":
    main()
