"""QLoRA with TRL's SFTTrainer on outcore: the base stored 4-bit (NF4, as bitsandbytes stores it), LoRA
adapters trained in bf16 or fp32, the states paged through NVMe. Your script, with one changed line.

    python examples/qlora_sft_trainer.py                                   # a tiny local model, offline
    python examples/qlora_sft_trainer.py --model /models/llama-8b --data chats.jsonl --nvme-dir /mnt/nvme/q

`--data`: a JSONL file of {"messages": [...]} rows (made here when not given). Afterwards
`outcore export OUT/checkpoint-N/outcore merged/ --merge-adapters` writes the merged model.
"""

import argparse
import os

import datasets
import peft
import torch
import transformers
import trl
from tiny_model import chats, tiny_llama, write_jsonl

import outcore
from outcore.hf import outcore_trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Hugging Face model directory (default: a tiny one built here)")
    p.add_argument("--data", help="a JSONL file of conversations (default: made here)")
    p.add_argument("--out", default="qlora-run")
    p.add_argument("--nvme-dir", default="qlora-nvme", help="where outcore pages the states")
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    model = a.model or tiny_llama(os.path.join(a.out, "tiny-llama"))
    data = a.data or write_jsonl(os.path.join(a.out, "chats.jsonl"), chats(32))

    args = trl.SFTConfig(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=2, learning_rate=2e-3,
                         logging_steps=1, save_steps=a.steps, assistant_only_loss=True, max_length=64, report_to=[],
                         bf16=torch.cuda.is_available())
    SFTTrainer = outcore_trainer(trl.SFTTrainer)  # was: trl.SFTTrainer
    trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.load_dataset("json", data_files=data)["train"],
                         peft_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
                         quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True,
                                                                             bnb_4bit_quant_type="nf4"),
                         outcore_config=outcore.Config(offload_params="nvme", offload_optimizer="nvme",
                                                       nvme_dir=a.nvme_dir))
    trainer.train()
    trainer.save_model()  # the adapters, which peft loads onto the base
    print(f"adapters in {a.out}; merged: outcore export {a.out}/checkpoint-{a.steps}/outcore merged/ --merge-adapters")


if __name__ == "__main__":
    main()
