"""What the engine knows of Hugging Face and peft models: a model's HF config (for config.json in an
export and in checkpoints), whether it is a peft model (its adapters are the trainable parameters a
weights directory does not hold)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from torch import nn

log = logging.getLogger(__name__)


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "base_model")


def wrapped_model(model: nn.Module) -> nn.Module:
    """The model itself: under peft, the base model it wraps (whose names the weight files use, and
    whose `generate()` a peft model calls), else `model`."""
    unwrap = getattr(model, "get_base_model", None)
    inner = unwrap() if callable(unwrap) else model
    return inner if isinstance(inner, nn.Module) else model


def hf_init_for(model: nn.Module, name: str) -> Callable[[nn.Module], None] | None:
    """The `_init_weights` transformers runs on the module `name` of `model`: that of the innermost
    Hugging Face model holding it (a multimodal model's vision tower has its own, which alone knows
    its embeddings' buffers); None outside any."""
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):
        holder = model.get_submodule(".".join(parts[:depth]))
        init = getattr(holder, "_init_weights", None)
        if callable(init) and hasattr(holder, "config"):
            return init
    return None


def parameter_adapters(model: nn.Module) -> list[str]:
    """The modules that are peft LoRA adapters on a bare parameter (`LoraConfig.target_parameters`)."""
    return [name for name, m in model.named_modules()
            if type(m).__name__ == "ParamWrapper" and type(m).__module__.startswith("peft.")]


def hf_checkpointing(model: nn.Module) -> Callable[[], None] | None:
    """A Hugging Face model's own activation checkpointing, non-reentrant (the engine's hooks then see
    both passes), as a call that turns it on; None for a model without it. transformers 5 names it
    `activation_checkpointing_enable` (the older name warns), earlier ones `gradient_checkpointing_enable`."""
    for name, kwargs in (("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
                         ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs")):
        enable = getattr(model, name, None)
        if callable(enable):
            return lambda: enable(**{kwargs: {"use_reentrant": False}})
    return None


def hf_config(model: nn.Module) -> object | None:
    """The Hugging Face config a model carries (`model.config` with `save_pretrained`), if any."""
    config = getattr(model, "config", None)
    return config if callable(getattr(config, "save_pretrained", None)) else None


def hf_config_writer(model: nn.Module) -> Callable[[str], None] | None:
    config = hf_config(model)
    if config is None:
        return None

    def write(directory: str) -> None:
        config.architectures = [type(model).__name__]  # type: ignore[attr-defined]  # as save_pretrained sets it
        # An export is a plain model, whatever the files it came from held: no quantization to redo on load.
        quantization = config.__dict__.pop("quantization_config", None)
        try:
            config.save_pretrained(directory)  # type: ignore[attr-defined]
        finally:
            if quantization is not None:
                config.quantization_config = quantization  # type: ignore[attr-defined]
        if _can_generate(model):  # as save_pretrained writes it
            model.generation_config.save_pretrained(directory)  # type: ignore[union-attr,operator]

    return write


def read_generation_config(model: nn.Module, directory: str) -> None:
    """As `from_pretrained` does: a model that generates takes the settings stored beside its
    weights (generation_config.json: end-of-sequence ids, sampling defaults), so that `generate()`
    and an export keep them. A model built from its config alone has only defaults derived from it;
    one whose settings the caller changed keeps them."""
    inner = wrapped_model(model)
    if _can_generate(inner) and os.path.isfile(os.path.join(directory, "generation_config.json")):
        from transformers import GenerationConfig

        own = inner.generation_config.to_diff_dict()  # type: ignore[union-attr,operator]
        if own != GenerationConfig.from_model_config(inner.config).to_diff_dict():  # type: ignore[arg-type]
            log.info("the model's generation_config was set before the engine: kept; %s/generation_config.json "
                     "is not read", directory)
            return
        try:
            inner.generation_config = GenerationConfig.from_pretrained(directory)  # type: ignore[assignment]
        except (OSError, ValueError) as e:  # transformers says which file and why
            raise ValueError(f"weights {directory!r}: generation_config.json does not load ({e}); mend it, or "
                             "remove it to generate with the defaults of the model's config.") from e


def hf_settings(model: nn.Module) -> dict[str, dict | None]:
    """A checkpoint's record of the model's Hugging Face configs, from which `outcore export` writes
    config.json and, for a model that generates, generation_config.json (values that differ from
    the defaults, as save_pretrained writes it); None where the model has no such config."""
    config, inner = hf_config(model), wrapped_model(model)
    stored = None if config is None else {**config.to_dict(),  # type: ignore[attr-defined]
                                          "architectures": [type(inner).__name__]}  # the export's class
    return {"hf_config": stored,
            "hf_generation_config": inner.generation_config.to_diff_dict()  # type: ignore[union-attr,operator]
            if _can_generate(inner) else None}


def _can_generate(model: nn.Module) -> bool:
    can = getattr(model, "can_generate", None)
    return callable(can) and bool(can()) and getattr(model, "generation_config", None) is not None
