"""At long context, attention that would hold a sequence x sequence tensor is refused in one line,
with the fix, before it allocates it.

Two ways a transformers model gets there: eager attention (the scores of every head, seq x seq, in
the compute dtype and again in fp32 for the softmax), and a 4-D attention mask (packed rows of
several samples, or padded rows: SDPA is then given the mask, which a CPU runs in its math kernel,
scores and all). From `LONG_CONTEXT` tokens on, either is refused as the attention layer is called;
below it, both cost little and run as they are. SDPA without a mask (one sample a row, no padding:
transformers passes `is_causal`) and FlashAttention (packed rows by their position_ids) hold no such
tensor. The engine installs the guard on every Hugging Face model (hf/model_family.py `check`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from outcore.runtime.sizes import human_bytes

LONG_CONTEXT = 8192  # tokens: a seq x seq tensor of one head is 64 Mi values here, and grows with the square
GUARDED = "_outcore_attention_guard"


def guard_attention(model: nn.Module) -> int:
    """Guard every decoder layer's attention of `model` (idempotent); the number guarded."""
    config = getattr(model, "config", None)
    guarded = 0
    for layer in model.modules():
        attention = getattr(layer, "self_attn", None)
        if not isinstance(attention, nn.Module) or getattr(attention, GUARDED, False):
            continue
        attention.register_forward_pre_hook(_guard(config), with_kwargs=True)
        setattr(attention, GUARDED, True)
        guarded += 1
    return guarded


def _guard(config: Any) -> Any:
    def check(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2 or hidden.shape[-2] < LONG_CONTEXT:
            return
        tokens = hidden.shape[-2]
        implementation = getattr(config, "_attn_implementation", None)
        if implementation == "eager":
            raise ValueError(f"eager attention at {tokens:,} tokens holds a {tokens:,} x {tokens:,} score matrix per "
                             f"head ({human_bytes(tokens * tokens * 4)} each in fp32): load the model with "
                             "attn_implementation='sdpa' (or 'flash_attention_2' on a GPU).")
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-1] >= LONG_CONTEXT:
            raise ValueError(f"a {mask.shape[-2]:,} x {mask.shape[-1]:,} attention mask at {tokens:,} tokens (packed "
                             "rows of several samples, or padded rows): SDPA then computes every score. Train rows of "
                             "one sample each, unpadded (samples of at least --seq tokens), or use "
                             "attn_implementation='flash_attention_2' on a GPU, which takes packed rows by their "
                             "position_ids.")
    return check
