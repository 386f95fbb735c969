"""The sizes a model's config.json gives, checked before anything is built or sized from them: a
negative width fails deep in torch, and a million layers takes minutes to build on the meta device
before any error could name it."""

from __future__ import annotations

from typing import Any

SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "vocab_size", "max_position_embeddings", "head_dim", "n_embd", "n_layer", "n_head", "n_positions",
         "d_model", "num_layers", "ffn_dim")
MOST_LAYERS = 1024  # the deepest published decoders have under 200 blocks; a larger count is a typo
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")


def check_sizes(config: Any, directory: str) -> None:
    """ValueError naming the first size of `config` (and of its text config) that is not a positive
    whole number, or a layer count past MOST_LAYERS."""
    configs = [config]
    text = getattr(config, "text_config", None)
    if text is not None and text is not config:
        configs.append(text)
    for cfg in configs:
        for key in SIZES:
            value = getattr(cfg, key, None)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--model {directory!r}: config.json's {key} is {value!r}; a size is a whole number "
                                 "of at least 1. Mend config.json.")
            if key in _LAYERS and value > MOST_LAYERS:
                raise ValueError(f"--model {directory!r}: config.json's {key} is {value:,}, past the {MOST_LAYERS} "
                                 "layers outcore builds (the deepest published models have under 200). Mend "
                                 "config.json.")
