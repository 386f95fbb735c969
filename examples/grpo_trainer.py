"""GRPO with TRL's GRPOTrainer on outcore: completions generated through the engine, scored by a
reward function of your own, the policy's states paged through NVMe.

    python examples/grpo_trainer.py                                        # a tiny local model, offline
    python examples/grpo_trainer.py --model /models/qwen-1.5b --nvme-dir /mnt/nvme/grpo

The reward here favours completions that say "good"; write yours with the same signature.
"""

import argparse
import os

import datasets
import peft
import torch
import transformers
import trl
from tiny_model import prompts, tiny_llama

import outcore
from outcore.hf import outcore_trainer


def says_good(completions: list[str], **_: object) -> list[float]:
    """One reward a completion: how often it says "good", less how often "bad"."""
    return [float(c.split().count("good") - c.split().count("bad")) for c in completions]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Hugging Face model directory (default: a tiny one built here)")
    p.add_argument("--out", default="grpo-run")
    p.add_argument("--nvme-dir", default="grpo-nvme")
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    model = a.model or tiny_llama(os.path.join(a.out, "tiny-llama"))

    args = trl.GRPOConfig(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, learning_rate=1e-2, logging_steps=1, save_steps=a.steps,
                          report_to=[],
                          bf16=torch.cuda.is_available(), beta=0.04)
    GRPOTrainer = outcore_trainer(trl.GRPOTrainer)  # was: trl.GRPOTrainer
    trainer = GRPOTrainer(model=model, reward_funcs=says_good, args=args,
                          train_dataset=datasets.Dataset.from_list(prompts(16)),
                          processing_class=transformers.AutoTokenizer.from_pretrained(model),
                          peft_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
                          outcore_config=outcore.Config(offload_params="nvme", offload_optimizer="nvme",
                                                        nvme_dir=a.nvme_dir))
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    print(f"mean reward by step: {', '.join(f'{r:.2f}' for r in rewards)}; adapters in {a.out}")
    trainer.save_model()


if __name__ == "__main__":
    main()
