"""The model a trainer builds from `model=` a path, built as outcore builds it.

TRL's trainers build from a path with `create_model_from_path(path, AutoClass, **model_init_kwargs)`:
a causal LM for most, a sequence classifier with one label (the reward) for `RewardTrainer`.
`BUILT_BY` names the classes that differ from the causal LM (a test reads TRL's sources, so that a
trainer added upstream fails there, by name). outcore builds the same class under `deferred_init()`
(hf/source.py) and reads the base's weights itself; a head the files lack is drawn here as
`from_pretrained` draws it: by the model's `_init_weights`, children before parents, on the global
RNG right after the trainer's `set_seed(args.seed)`, so that it and the adapters peft draws next
equal the plain trainer's.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from outcore.hf.model_info import hf_init_for
from outcore.hf.task_head import task_head

# trainer class name -> (the transformers Auto class it builds from a path, from_pretrained's keyword arguments)
BUILT_BY: dict[str, tuple[str, dict[str, Any]]] = {
    "RewardTrainer": ("AutoModelForSequenceClassification", {"num_labels": 1}),
}


def built_class(trainer: type) -> tuple[str | None, dict[str, Any]]:
    """The Auto class `trainer` builds from a path and the config settings it passes (None: a causal LM)."""
    for cls in trainer.__mro__:
        if cls.__name__ in BUILT_BY:
            auto_class, settings = BUILT_BY[cls.__name__]
            return auto_class, dict(settings)
    return None, {}


def draw_new_head(model: nn.Module, weights: str) -> list[str]:
    """Give values to the parameters of `model`'s task head that the files in `weights` lack, as
    `from_pretrained` initializes them (see the module's docstring); their module names, in the order
    drawn. Nothing where the files are of the model's own architecture."""
    head = task_head(model, weights)
    if head is None:
        return []
    drawn: list[str] = []

    def visit(module: nn.Module, name: str) -> None:
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)
        own = list(module.parameters(recurse=False))
        if own and all(p.is_meta for p in own) and head.outside_base(name):
            init = hf_init_for(model, name)
            if init is None:
                raise ValueError(f"{name!r} is new to the weights in {weights!r} and no Hugging Face model holds it "
                                 "to initialize it.")
            module.to_empty(device="cpu", recurse=False)
            init(module)
            drawn.append(name)

    visit(model, "")
    return drawn
