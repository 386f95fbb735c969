"""What `trainer.model` answers when a script's last lines ask it, its parameters in the engine's tiers.

After `trainer.train()` many scripts end with `print_trainable_parameters()`, `save_pretrained(d)`,
`merge_and_unload()` or `generate(...)`. The module's parameters rest in the engine's store, not on
it, so peft's and transformers' own methods would count nothing, save nothing or read released
parameters. `answer_through_engine` puts methods on the model instance that answer from the engine:
the true parameter counts (of the engine's units), `save_pretrained` as the trainer's `save_model`
(the adapters for a peft model, the model otherwise), and `merge_and_unload` refused in one line
naming the streamed merge. `generate` needs nothing: the engine's hooks gather each unit as it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from outcore.runtime.engine import Engine

# save_pretrained's keyword arguments that change nothing in what save_model writes
_SAME_BYTES = {"safe_serialization": True, "is_main_process": None, "max_shard_size": None}


def parameter_counts(engine: Engine) -> tuple[int, int]:
    """(trainable, all) parameters of the engine's model, each tied parameter once."""
    slots = [s for u in engine.units for s in u.plan.slots]
    return sum(s.numel for s in slots if not s.frozen), sum(s.numel for s in slots)


def answer_through_engine(model: nn.Module, engine: Engine, save: Callable[[str], None]) -> None:
    """Methods on `model` (the instance) that answer from `engine`; `save(d)` writes what the
    trainer's `save_model(d)` writes."""
    def get_nb_trainable_parameters() -> tuple[int, int]:
        return parameter_counts(engine)

    def print_trainable_parameters() -> None:
        trainable, total = parameter_counts(engine)
        print(f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: "
              f"{100 * trainable / total:.4f}")

    def save_pretrained(save_directory: str, **kwargs: Any) -> None:
        other = {k: v for k, v in kwargs.items() if k not in _SAME_BYTES or (_SAME_BYTES[k] is not None
                                                                             and v != _SAME_BYTES[k])}
        if other:
            raise ValueError(f"save_pretrained({', '.join(f'{k}={v!r}' for k, v in other.items())}): outcore writes "
                             "what trainer.save_model(d) writes, streamed from the engine; call it with the "
                             "directory alone.")
        save(save_directory)

    def merge_and_unload(*_: Any, **__: Any) -> nn.Module:
        raise RuntimeError("merge_and_unload(): the model lives in outcore's tiers, never whole in memory; write the "
                           "merged model with trainer.engine.export(d, merge_adapters=True), or from a checkpoint "
                           "with `outcore export CKPT d --merge-adapters`, and load d with from_pretrained.")

    answers: dict[str, Callable[..., Any]] = {
        "get_nb_trainable_parameters": get_nb_trainable_parameters, "save_pretrained": save_pretrained,
        "print_trainable_parameters": print_trainable_parameters, "merge_and_unload": merge_and_unload}
    for name, method in answers.items():
        if hasattr(model, name) or name == "get_nb_trainable_parameters":
            object.__setattr__(model, name, method)  # on the instance, in front of the class's own
