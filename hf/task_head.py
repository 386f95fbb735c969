"""A task head over another architecture's weights: a model for sequence classification (a reward
model, a classifier) fine-tuned from the files of a causal LM or a masked LM.

transformers' `from_pretrained` loads such files into the task model's base model, initializes the
head the files lack with the model's `_init_weights`, and skips the stored head the task model has no
place for, warning of both. `Engine(weights=...)` does the same and no more: only where the weights
directory's config.json names an architecture other than the model's class, and only outside the
base model (`base_model_prefix`). Inside it, a missing or unexpected tensor stays an error, as it
is for files of the model's own architecture.

Each new module is drawn from a generator seeded by its name and the engine's seed, so every rank
draws the same values, and a module peft trains whole (`modules_to_save`) starts its trained copy
equal to its frozen original, as peft's copy does.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from outcore.hf.model_info import hf_init_for, wrapped_model


@dataclass(frozen=True, slots=True)
class TaskHead:
    model_class: str  # the model's, e.g. LlamaForSequenceClassification
    stored_class: str  # the files', e.g. LlamaForCausalLM
    prefix: str  # the base model's parameters are named `prefix.`...

    def outside_base(self, name: str) -> bool:
        return not name.startswith(self.prefix + ".")


def task_head(model: nn.Module, weights: str) -> TaskHead | None:
    """The task head `model` puts on the files of `weights`, or None where the files are of the
    model's own architecture, say nothing of theirs, or the model is a base model itself."""
    base = wrapped_model(model)
    prefix = getattr(base, "base_model_prefix", None)
    if not isinstance(prefix, str) or not prefix or getattr(base, "base_model", base) is base:
        return None
    stored = _architectures(weights)
    if not stored or type(base).__name__ in stored:
        return None
    return TaskHead(type(base).__name__, stored[0], prefix)


def _architectures(weights: str) -> list[str]:
    path = os.path.join(weights, "config.json")
    if not os.path.isdir(weights) or not os.path.isfile(path):
        return []
    try:
        with open(path) as f:
            names = json.load(f).get("architectures")
    except (OSError, ValueError, AttributeError):
        return []  # a config.json transformers could not read either: the strict check applies
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def seeded_init(model: nn.Module, module: str, name: str, seed: int) -> Callable[[nn.Module], None]:
    """The `_init_weights` transformers runs on `module` (its name in `model`), drawing from a
    generator seeded by `name` (a new parameter's, as the files would spell it) and the engine's seed."""
    init = hf_init_for(model, module)
    if init is None:
        raise ValueError(f"{module!r} is new to the weights and no Hugging Face model holds it to initialize it.")
    draw = zlib.crc32(name.encode()) ^ (seed * 1_000_003)

    def initialize(module: nn.Module) -> None:
        with torch.random.fork_rng(devices=[]):  # the unit's own stream draws on for its other modules
            torch.manual_seed(draw)
            init(module)
    return initialize
