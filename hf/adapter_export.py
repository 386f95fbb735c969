"""A peft model's adapters as `peft.PeftModel.from_pretrained` loads them: the tensors of
adapter_model.safetensors, named as peft names them, and adapter_config.json. The engine gathers
the trainable parameters and writes the file (runtime/checkpoint/state_dict.py); this names them."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)


def peft_adapter_tensors(peft_model: nn.Module,
                         adapters: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Callable[[str], None]]:
    """From the trainable parameters' values by state-dict name: the active adapter's tensors as peft
    saves them, and a call writing its adapter_config.json into a directory."""
    from peft import get_peft_model_state_dict

    active = getattr(peft_model, "active_adapter")  # noqa: B009 - an nn.Module attribute mypy sees as a Tensor
    # Not the base embedding, which peft adds where an embedding is adapted: the base model's own
    # files hold it, and it would mean gathering frozen units.
    state = get_peft_model_state_dict(peft_model, state_dict=adapters, save_embedding_layers=False)
    state.update(_trained_whole(peft_model, adapters, active))
    if not state:
        raise ValueError("the model has no adapter parameters to export; adapters_only=True is for peft models.")
    configs: dict = getattr(peft_model, "peft_config")  # noqa: B009 - an nn.Module attribute mypy sees as a Tensor
    init = getattr(configs[active], "init_lora_weights", True)
    if isinstance(init, str) and "_niter_" in init:
        log.warning("export: init_lora_weights=%r trains against a residual drawn at random, which peft draws "
                    "again when it loads these adapters, so the loaded model differs from the trained one; "
                    "export(merge_adapters=True) writes the trained model exactly.", init)
    return state, configs[active].save_pretrained


def _trained_whole(peft_model: nn.Module, adapters: dict[str, torch.Tensor], adapter: str) -> dict[str, torch.Tensor]:
    """The modules peft trains whole (`modules_to_save`), under the names peft saves them by (the
    wrapper's own, `<module>.weight`). peft finds their tensors through the module's state_dict(),
    which under the engine holds no parameters, so they are taken from `adapters` here."""
    out = {}
    for path, module in peft_model.named_modules():
        if type(module).__name__ == "ModulesToSaveWrapper" and adapter in getattr(module, "modules_to_save", {}):
            copy = f"{path}.modules_to_save.{adapter}."
            out.update({f"{path}.{name[len(copy):]}": v for name, v in adapters.items() if name.startswith(copy)})
    return out
