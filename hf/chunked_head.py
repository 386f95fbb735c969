"""The loss over chunks (runtime/chunked_loss.py) installed on a Hugging Face causal LM: with labels,
its forward runs the decoder, then its head and the cross-entropy a chunk of tokens at a time, so the
logits are never whole. Without labels (generation, evaluation of logits) it is the model's own.

    install_chunked_loss(model, chunk_tokens=1024)   # before outcore.Engine(model, ...)

The loss is the model's own (transformers' `ForCausalLMLoss`: labels shifted by one, -100 ignored,
summed over `num_items_in_batch` where the caller gives it, else averaged over the tokens that carry
a label; Gemma 2's final soft-cap), to rounding. The head is called as a module, so the engine's
hooks gather its unit once for all the chunks, and again once for backward. The output carries the
loss and no logits (`logits` is None): a caller that reads the logits of a labelled forward (TRL's
token accuracy) must not install it. A model whose head is not a plain Linear, or whose logits are
scaled in ways outcore does not know, is refused in one line.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from outcore.runtime.chunked_loss import IGNORE, chunked_cross_entropy

CHUNK_BYTES = 256 << 20  # a chunk's fp32 logits, their loss and its gradient at most (`chosen_chunk`)
CALLS_HEAD = "outcore_calls_head"  # marks a replaced forward that calls the head module (hf/model_family.py)
_KNOWN_SCALING = ("logit_scale", "logits_scaling", "output_multiplier_scale")  # other models' logit factors


def chosen_chunk(vocab: int) -> int:
    """A chunk where none is given: the most tokens (a power of two, 256 to 8,192) whose fp32 logits,
    their loss and its gradient (3 values of the vocabulary a token) take at most `CHUNK_BYTES`."""
    fits = CHUNK_BYTES // (3 * vocab * 4)
    return min(8192, max(256, 1 << max(0, fits.bit_length() - 1)))


def install_chunked_loss(model: nn.Module, chunk_tokens: int) -> None:
    """Make `model`'s labelled forward compute its loss over chunks of `chunk_tokens` tokens."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}: a chunk is at least one token.")
    head, decoder = getattr(model, "lm_head", None), getattr(model, "model", None)
    config = getattr(model, "config", None)
    if not isinstance(head, nn.Linear) or head.bias is not None or not isinstance(decoder, nn.Module):
        raise ValueError(f"{type(model).__name__}: the loss over chunks needs a causal LM with a decoder `model` and a "
                         "bias-free Linear `lm_head`; leave it off for this model.")
    scaled = [k for k in _KNOWN_SCALING if getattr(config, k, None) not in (None, 1, 1.0)]
    if scaled:
        raise ValueError(f"{type(model).__name__}: its config scales the logits ({scaled[0]}), which the loss over "
                         "chunks does not; leave it off for this model.")
    own = type(model).forward
    cap = getattr(config, "final_logit_softcapping", None)

    def forward(self: nn.Module, *args: Any, labels: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | int | None = None, **kwargs: Any) -> Any:
        if labels is None:
            return own(self, *args, num_items_in_batch=num_items_in_batch, **kwargs) \
                if num_items_in_batch is not None else own(self, *args, **kwargs)
        kwargs.pop("logits_to_keep", None)
        outputs = self.model(*args, **kwargs)
        hidden = outputs.last_hidden_state
        shifted = nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:].reshape(-1).to(hidden.device)
        loss = _head_loss(self.lm_head, hidden.reshape(-1, hidden.shape[-1]), shifted, chunk_tokens, cap,
                          None if num_items_in_batch is None else float(num_items_in_batch))
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=getattr(outputs, "past_key_values", None),
                                      hidden_states=getattr(outputs, "hidden_states", None),
                                      attentions=getattr(outputs, "attentions", None))

    setattr(forward, CALLS_HEAD, True)  # the head is called as a module: it may stay a unit of its own
    model.forward = types.MethodType(forward, model)


def _head_loss(head: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, chunk: int, cap: float | None,
               normalizer: float | None) -> torch.Tensor:
    """The chunked loss computed inside the head module's own call, so that whatever gathers its
    parameters around that call (the engine's hooks) does so once."""
    def loss_forward(x: torch.Tensor) -> torch.Tensor:
        return chunked_cross_entropy(x, head.weight, labels, chunk=chunk, cap=cap, normalizer=normalizer)

    head.forward = loss_forward  # type: ignore[method-assign,assignment]
    try:
        return head(hidden)
    finally:
        del head.forward
