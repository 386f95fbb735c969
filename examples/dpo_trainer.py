"""DPO with TRL's DPOTrainer on outcore: with LoRA the reference is the base with the adapters off (no
second copy of the model); the policy's states paged through NVMe.

    python examples/dpo_trainer.py                                         # a tiny local model, offline
    python examples/dpo_trainer.py --model /models/llama-8b --data prefs.jsonl --nvme-dir /mnt/nvme/dpo

`--data`: a JSONL file of {"prompt", "chosen", "rejected"} rows (made here when not given).
"""

import argparse
import os

import datasets
import peft
import torch
import transformers
import trl
from tiny_model import preferences, tiny_llama, write_jsonl

import outcore
from outcore.hf import outcore_trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Hugging Face model directory (default: a tiny one built here)")
    p.add_argument("--data", help="a JSONL file of preference rows (default: made here)")
    p.add_argument("--out", default="dpo-run")
    p.add_argument("--nvme-dir", default="dpo-nvme")
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    model = a.model or tiny_llama(os.path.join(a.out, "tiny-llama"))
    data = a.data or write_jsonl(os.path.join(a.out, "prefs.jsonl"), preferences(32))

    args = trl.DPOConfig(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=2, learning_rate=5e-3,
                         logging_steps=1, save_steps=a.steps, max_length=32, report_to=[],
                         bf16=torch.cuda.is_available(), beta=0.1)
    DPOTrainer = outcore_trainer(trl.DPOTrainer)  # was: trl.DPOTrainer
    trainer = DPOTrainer(model=model, args=args, train_dataset=datasets.load_dataset("json", data_files=data)["train"],
                         processing_class=transformers.AutoTokenizer.from_pretrained(model),
                         peft_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
                         outcore_config=outcore.Config(offload_params="nvme", offload_optimizer="nvme",
                                                       nvme_dir=a.nvme_dir))
    trainer.train()
    rewards = [h["rewards/margins"] for h in trainer.state.log_history if "rewards/margins" in h]
    print(f"reward margin {rewards[0]:.4f} -> {rewards[-1]:.4f}; adapters in {a.out}")
    trainer.save_model()


if __name__ == "__main__":
    main()
