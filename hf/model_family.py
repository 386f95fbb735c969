"""The engine's questions about a model (runtime/model_family.py) answered for Hugging Face models:
transformers' models, and peft's wrappers around them.

Each answer is one of this package's modules: names and configs (hf/model_info.py), stored-name
conversions (hf/conversion.py), adapters' initialization (hf/adapter_init.py) and merge
(hf/adapter_merge.py), task heads over another architecture's files (hf/task_head.py).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from outcore.hf import adapter_init, model_info
from outcore.hf.adapter_merge import adapter_merge, merge_record
from outcore.hf.attention_guard import guard_attention
from outcore.hf.chunked_head import CALLS_HEAD, chosen_chunk, install_chunked_loss
from outcore.hf.conversion import MergedTensor, assemble, convert_names
from outcore.hf.task_head import seeded_init, task_head
from outcore.hf.tiled_mlp import chosen_tile, install_tiled_mlp
from outcore.runtime.model_family import (
    AdapterFiles,
    ComposedTensor,
    ModelFamily,
    NewHead,
    ReadBase,
    StoredPart,
    TensorMerge,
)

log = logging.getLogger(__name__)

_TRAINED_WHOLE = re.compile(r"\.(original_module|modules_to_save\.[^.]+|token_adapter)\.")
"""A peft `ModulesToSaveWrapper`'s two places for the module it wraps, and the place a
`TrainableTokensWrapper` keeps it (`trainable_token_indices`)."""


def hugging_face_family(model: nn.Module) -> ModelFamily | None:
    """The Hugging Face family for a model any of whose modules is a transformers or peft class (or a
    subclass of one), else None."""
    for m in model.modules():
        if any(c.__module__.startswith(("transformers.", "peft.")) for c in type(m).__mro__):
            return HuggingFaceFamily(model)
    return None


class HuggingFaceFamily(ModelFamily):
    def inner(self) -> nn.Module:
        return model_info.wrapped_model(self.model)

    def stored_name(self, name: str) -> str:
        """peft's wrapping taken off: `base_model.model.` and `.base_layer`, and the places where a
        module trained whole keeps its copies."""
        if name.startswith("base_model.model."):
            name = name[len("base_model.model."):]
        return _TRAINED_WHOLE.sub(".", name.replace(".base_layer.", "."))

    def is_trained_copy(self, name: str) -> bool:
        return _TRAINED_WHOLE.search(name) is not None

    def has_adapters(self) -> bool:
        return model_info.is_peft(self.model)

    def read_outside_forward(self) -> list[nn.Module]:
        """The output head, where the model's forward was replaced on the instance (TRL's fused LM head,
        Liger's kernels): such a forward projects through the head's weight without calling the head.
        Said once. A forward marked as calling the head (CALLS_HEAD) leaves it where it is."""
        inner = self.inner()
        head = _declared(inner, "get_output_embeddings")
        replaced = vars(inner).get("forward")
        if replaced is None or getattr(replaced, CALLS_HEAD, False) or not isinstance(head, nn.Module):
            return []  # (hf/chunked_head.py's forward calls the head: it may be a unit of its own)
        log.info("%s's forward is replaced on the model (a fused LM head): its output head stays in the root unit",
                 type(inner).__name__)
        return [head]

    def check(self) -> None:
        adapter_init.check_adapter_inits(self.model)
        _refuse_parameter_adapters(self.model)
        guard_attention(self.model)  # at long context, no seq x seq tensor: hf/attention_guard.py

    def split_sequence(self, loss_chunk: int | str | None, tile: int | str | None, free_memory: int) -> None:
        inner = self.inner()
        config = getattr(inner, "config", None)
        if loss_chunk is not None:
            vocab = getattr(config, "vocab_size", None)
            chunk = loss_chunk if loss_chunk != "auto" else chosen_chunk(vocab) if isinstance(vocab, int) else None
            if chunk is None:
                raise ValueError(f"loss_chunk_tokens='auto': {type(inner).__name__}'s config names no vocab_size to "
                                 "choose a chunk from; give a number of tokens.")
            install_chunked_loss(inner, int(chunk))
        if tile is not None:
            if tile == "auto":
                width = getattr(config, "hidden_size", None)
                if not isinstance(width, int):
                    raise ValueError(f"tile_tokens='auto': {type(inner).__name__}'s config names no hidden_size to "
                                     "choose a tile from; give a number of tokens.")
                tile = chosen_tile(width, free_memory)
            install_tiled_mlp(self.model, int(tile))

    def init_for(self, name: str) -> Callable[[nn.Module], None] | None:
        return model_info.hf_init_for(self.model, name)

    @functools.cached_property
    def _adapter_configs(self) -> dict[str, object]:
        return adapter_init.adapter_configs(self.model)

    def adapter_layers(self, modules: Sequence[nn.Module]) -> list[nn.Module]:
        return [m for m in modules if adapter_init.is_tuner_layer(m)]

    def drawn_adapter_parts(self, layers: Sequence[nn.Module]) -> tuple[set[nn.Module], set[nn.Module]]:
        drawn: set[nn.Module] = {d for m in layers for parts in adapter_init.adapter_parts(m).values() for d in parts
                 if isinstance(d, nn.ParameterDict)}  # drawn as peft creates them: a LoRA embedding's, IA3's
        later = {d for m in layers for d in adapter_init.magnitudes(m).values()}  # DoRA's, from the base weight
        return drawn, later

    def initialize_adapters(self, layer: nn.Module, name: str, fresh: set[nn.Module], read_base: ReadBase) -> None:
        adapter_init.initialize_adapters(layer, name, fresh, self._adapter_configs, read_base)

    def computed_buffers(self) -> set[nn.Module]:
        return adapter_init.computed_buffers(self.model)

    def convert_names(self, stored: dict[str, Any], wanted: set[str]) -> tuple[dict[str, Any], int]:
        return convert_names(self.model, stored, wanted)

    def assemble(self, composed: ComposedTensor, read: Callable[[StoredPart], torch.Tensor]) -> torch.Tensor:
        assert isinstance(composed, MergedTensor)
        return assemble(composed, read, self.model)

    def new_head(self, weights: str) -> NewHead | None:
        return task_head(self.model, weights)

    def head_initializer(self, module: str, name: str, seed: int) -> Callable[[nn.Module], None]:
        return seeded_init(self.model, module, name, seed)

    def kept_whole(self) -> set[nn.Module]:
        """The embeddings and the output head, which transformers' bitsandbytes loading leaves whole."""
        base = self.inner()
        return {m for m in (_declared(base, "get_input_embeddings"), _declared(base, "get_output_embeddings"))
                if isinstance(m, nn.Module)}

    def vocabulary_names(self) -> set[str]:
        """The input embedding's weight and the output head's weight and bias."""
        base = self.inner()
        ends = [m for m in (_declared(base, "get_input_embeddings"), _declared(base, "get_output_embeddings"))
                if isinstance(m, nn.Module)]
        return {self.stored_name(f"{name}.{p}") for name, m in base.named_modules() if any(m is e for e in ends)
                for p in ("weight", "bias")}

    def read_settings(self, directory: str) -> None:
        model_info.read_generation_config(self.model, directory)

    def checkpoint_record(self, state_dict_keys: list[str]) -> dict[str, Any]:
        """The configs, the adapters' merge, and the directory the model came from (for its tokenizer)."""
        source = getattr(self.inner(), "name_or_path", None)
        local = os.path.abspath(source) if isinstance(source, str) and os.path.isdir(source) else None
        return {**model_info.hf_settings(self.model), **merge_record(self.model, state_dict_keys),
                "hf_source": local}

    def config_writer(self) -> Callable[[str], None] | None:
        return model_info.hf_config_writer(self.inner())

    def adapter_merge(self, state_dict_keys: list[str]) -> TensorMerge:
        return adapter_merge(self.model, state_dict_keys)

    def adapter_tensors(self, adapters: dict[str, torch.Tensor]) -> AdapterFiles:
        from outcore.hf.adapter_export import peft_adapter_tensors

        return peft_adapter_tensors(self.model, adapters)


def _declared(model: nn.Module, getter: str) -> object:
    """What the model's `getter` returns, or None where it has none: transformers' default raises
    NotImplementedError for models with no single embedding (CLIP's text and vision towers)."""
    try:
        return getattr(model, getter, lambda: None)()
    except NotImplementedError:
        return None


def _refuse_parameter_adapters(model: nn.Module) -> None:
    """peft's LoRA on a bare parameter (`target_parameters`: a mixture of experts' fused experts and
    router, which "all-linear" targets under transformers 5) registers a torch parametrization on
    the wrapped module at every forward, and that needs the parameter registered there; the engine
    puts views of its units in place of parameters, so it cannot run. Refused here, by name."""
    wrapped = model_info.parameter_adapters(model)
    if wrapped:
        raise ValueError(f"{wrapped[0]}{f' (and {len(wrapped) - 1} more)' if len(wrapped) > 1 else ''} is a peft "
                         "LoRA adapter on a bare parameter (LoraConfig.target_parameters), which the engine cannot "
                         "page: it swaps the parameter itself at every forward. Put adapters on modules only, e.g. "
                         "LoraConfig(target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']).")
