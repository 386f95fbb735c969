"""A loss over chunks of tokens: a causal LM's head and cross-entropy (or its tokens' log-probabilities)
computed a chunk of rows at a time, in forward and again in backward, so that no more than one chunk x
the vocabulary of logits is ever in memory (fp32 for the loss).

The logits of one 64K-token sample over a 128K vocabulary are 32 GB in fp32, and autograd would keep
them, their softmax and their gradient; here each chunk's logits live for one matrix product, one
log-sum-exp and, in backward, one more product each way. The head's weight is read once for all the
chunks of a pass (it is an argument, gathered by its unit before the call).

`chunked_cross_entropy` equals `F.cross_entropy(hidden @ weight.T, labels, ignore_index=-100,
reduction="sum") / normalizer` (with soft-capping `cap * tanh(logits / cap)` first, as Gemma 2 caps),
value and gradients, to rounding: the same fp32 operations, summed chunk by chunk. `chunked_log_probs`
gives each token's log-probability of its label (0 where ignored), as preference and RL trainers sum
them per sequence. runtime/ knows only this; the Hugging Face wing decides where a model uses it.
"""

from __future__ import annotations

from typing import Any

import torch

IGNORE = -100


def _logits(hidden: torch.Tensor, weight: torch.Tensor, cap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk's fp32 logits, soft-capped where `cap` is set; and the tanh the cap took (for backward)."""
    logits = (hidden @ weight.t()).float()
    if cap is None:
        return logits, None
    squashed = torch.tanh(logits / cap)
    return squashed * cap, squashed


def _rows(n: int, chunk: int) -> range:
    return range(0, n, chunk)


class _ChunkedTokenLoss(torch.autograd.Function):
    """Per token: -log p(label) (`log_probs=False`, summed and divided by `normalizer`) or log p(label)
    (`log_probs=True`, one value a token); the logits never whole (see the module's docstring)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                cap: float | None, normalizer: float, log_probs: bool) -> torch.Tensor:
        keep = labels != IGNORE
        safe = labels.masked_fill(~keep, 0)
        out = torch.zeros(labels.shape[0], dtype=torch.float32, device=hidden.device)
        for at in _rows(labels.shape[0], chunk):
            logits, _ = _logits(hidden[at : at + chunk], weight, cap)
            picked = logits.gather(1, safe[at : at + chunk, None]).squeeze(1)
            out[at : at + chunk] = picked - torch.logsumexp(logits, dim=1)
        out = out.masked_fill(~keep, 0.0)
        ctx.save_for_backward(hidden, weight, safe, keep)
        ctx.chunk, ctx.cap, ctx.normalizer, ctx.log_probs = chunk, cap, normalizer, log_probs
        return out if log_probs else -out.sum() / normalizer

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, safe, keep = ctx.saved_tensors
        # d(log p(label))/d logits = onehot(label) - softmax; the loss is minus their sum over the normalizer
        per_token = grad.float() * keep if ctx.log_probs else (-grad.float() / ctx.normalizer) * keep.float()
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for at in _rows(safe.shape[0], ctx.chunk):
            rows = hidden[at : at + ctx.chunk]
            logits, squashed = _logits(rows, weight, ctx.cap)
            d = -torch.softmax(logits, dim=1)
            d.scatter_add_(1, safe[at : at + ctx.chunk, None], torch.ones_like(d[:, :1]))
            d.mul_(per_token[at : at + ctx.chunk, None])
            if squashed is not None:  # through cap * tanh(x / cap)
                d.mul_(1 - squashed * squashed)
            if grad_hidden is not None:  # in the weight's dtype, as autograd takes the model's own (no fp32 copy
                grad_hidden[at : at + ctx.chunk] = (d.to(weight.dtype) @ weight).to(hidden.dtype)  # of it a chunk)
            if grad_weight is not None:
                grad_weight.addmm_(d.t(), rows.float())
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None,
                None)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk: int,
                          cap: float | None = None, normalizer: float | None = None) -> torch.Tensor:
    """The summed cross-entropy of `labels` (N tokens, IGNORE where none) under the logits `hidden @
    weight.T` (hidden: N x H; weight: V x H), divided by `normalizer` (default: the tokens that carry a
    label, as `reduction="mean"` divides; transformers' `num_items_in_batch` where the Trainer gives
    one); `chunk` rows of logits at a time."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: a chunk is at least one token.")
    if normalizer is None:
        normalizer = max(int((labels != IGNORE).sum()), 1)
    return _ChunkedTokenLoss.apply(hidden, weight, labels, chunk, cap, float(normalizer), False)


def chunked_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk: int,
                      cap: float | None = None) -> torch.Tensor:
    """Each token's log-probability of its label (fp32, N; 0 where the label is IGNORE), the logits
    `hidden @ weight.T` computed `chunk` rows at a time."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: a chunk is at least one token.")
    return _ChunkedTokenLoss.apply(hidden, weight, labels, chunk, cap, 1.0, True)
