"""A Hugging Face model directory as `outcore train` and `estimate` see it: its config, its own
tokenizer and, optionally, LoRA adapters. Local files only: nothing is looked up on a hub.

The model is built from `config.json` under `deferred_init()` (no weights in memory); the engine
then reads its safetensors files itself (`Engine(weights=DIR)`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from torch import nn

from outcore.runtime.materialize import deferred_init


def is_hf_directory(spec: str) -> bool:
    return os.path.isdir(spec)


@dataclass(frozen=True)
class HFModel:
    directory: str
    lora_rank: int | None = None  # None: full fine-tuning

    def __post_init__(self) -> None:
        if not os.path.exists(os.path.join(self.directory, "config.json")):
            raise ValueError(f"--model {self.directory!r} has no config.json; name a Hugging Face model "
                             "directory (config.json, *.safetensors and the tokenizer's files).")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ValueError(f"--lora {self.lora_rank}: the adapters' rank must be at least 1.")

    def config(self):
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(self.directory, local_files_only=True)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"--model {self.directory!r}: its config.json does not load ({first}).") from e

    def build(self) -> nn.Module:
        """The model, parameters on the meta device, with LoRA adapters when asked for."""
        from transformers import AutoModelForCausalLM

        config = self.config()
        with deferred_init():
            try:
                model = AutoModelForCausalLM.from_config(config)
            except ValueError as e:  # transformers lists every causal-LM config class, over many lines
                raise ValueError(f"--model {self.directory!r} is a {config.model_type!r} model "
                                 f"({type(config).__name__}), which transformers builds no causal language model "
                                 "from; the command line fine-tunes causal LMs. Other models train through "
                                 "outcore.Engine in Python.") from e
        if self.lora_rank is None:
            return model
        import peft

        lora = peft.LoraConfig(r=self.lora_rank, lora_alpha=2 * self.lora_rank, target_modules="all-linear",
                               lora_dropout=0.0, task_type="CAUSAL_LM")
        return peft.get_peft_model(model, lora)

    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.directory, local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"--model {self.directory!r}: no tokenizer found in it ({type(e).__name__}); "
                             "save one there with tokenizer.save_pretrained(DIR).") from e
