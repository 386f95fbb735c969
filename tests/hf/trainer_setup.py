"""A tiny Llama, its tokenizer and data, and the trainer arguments the Trainer tests share."""

from __future__ import annotations

import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from hf_models import STORY, VOCAB, config, save_tokenizer  # noqa: E402

import outcore  # noqa: E402

TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {% if m['role'] == 'assistant' %}{% generation %}"
            "{{ m['content'] }} </s>{% endgeneration %}{% else %}{{ m['content'] }} {% endif %}{% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")


def model_dir(directory: str, vocab: int = VOCAB) -> str:
    """A tiny Llama saved with save_pretrained, and a word-level tokenizer with a chat template.
    With a `vocab` of 512 its head outweighs a block, so that the engine makes it a unit of its own."""
    import transformers

    c = config("llama")
    c.vocab_size = vocab
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(c).save_pretrained(directory)
    save_tokenizer(directory, STORY + " user assistant : ")
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    tok.pad_token, tok.chat_template = "</s>", TEMPLATE
    tok.save_pretrained(directory)
    return directory


class TokenRows(torch.utils.data.Dataset):
    """Rows of token ids trained on every token (labels = input_ids), as a causal LM's data collator gives."""

    def __init__(self, n: int = 24, seq: int = 16, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(0, VOCAB, (seq,), generator=g) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}


def conversations(n: int = 24, seed: int = 0):
    """A `datasets.Dataset` of {"messages": [user, assistant]} rows over the tokenizer's words."""
    import datasets

    words, rnd = STORY.split(), random.Random(seed)
    return datasets.Dataset.from_list([
        {"messages": [{"role": "user", "content": " ".join(rnd.choices(words, k=5))},
                      {"role": "assistant", "content": " ".join(rnd.choices(words, k=4))}]} for _ in range(n)])


def trainer_args(output_dir: str, cls=None, **overrides):
    """6 steps of batch 2, 2 micro-batches a step, cosine with warmup, clipping and weight decay; fp32."""
    import transformers

    kw = dict(output_dir=output_dir, max_steps=6, per_device_train_batch_size=2, gradient_accumulation_steps=2,
              learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=2, max_grad_norm=1.0, weight_decay=0.1,
              logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=7, bf16=False,
              dataloader_num_workers=0)
    kw.update(overrides)
    return (cls or transformers.TrainingArguments)(**kw)


def nvme_config(directory: str) -> outcore.Config:
    return outcore.Config(offload_params="nvme", offload_optimizer="nvme", nvme_dir=directory)


def logged(trainer, key: str = "loss") -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]
