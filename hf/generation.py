"""Trainers that generate their own completions (TRL's GRPO and RLOO), generating through the engine.

Between optimizer steps they call `generate` on the policy: under outcore the engine's model,
whose decoding passes keep what fits in the budgets gathered for the whole call and read the
rest again each token (runtime/forward_cycle.py [Note: forward cycles]). The start of `train()`
says how much that is, once; README's GRPO section has the figures. What would hold a second
copy of the weights outside the tiers is refused:

- vLLM (`use_vllm=True`) keeps the whole model on the GPU;
- `sync_ref_model=True` mixes the policy's weights into the reference's in place, and both rest in
  the engines' tiers;
- transformers' continuous batching (`use_transformers_continuous_batching=True`) runs its own paged
  cache and kernels, which the engine's hooks are not tested under.
"""

from __future__ import annotations

from typing import Any

from outcore.hf.trained_model import parameter_counts
from outcore.runtime.engine import Engine
from outcore.runtime.policy import DTYPES
from outcore.runtime.sizes import human_bytes

GENERATING = ("GRPOTrainer", "RLOOTrainer")  # TRL's trainers that sample completions from the policy


def generates(trainer: type) -> bool:
    return any(c.__name__ in GENERATING for c in trainer.__mro__)


def generation_refusals(args: Any) -> list[str]:
    """The settings of a generating trainer outcore cannot honour, each as the sentence that says so."""
    out = []
    if getattr(args, "use_vllm", False):
        out.append("use_vllm=True: vLLM holds the whole model on the GPU, which outcore exists not to need; "
                   "leave it False, and completions are generated through the engine.")
    if getattr(args, "use_transformers_continuous_batching", False):
        out.append("use_transformers_continuous_batching=True: its paged cache and kernels are not tested under "
                   "the engine's hooks; leave it False.")
    if getattr(args, "sync_ref_model", False):
        out.append("sync_ref_model=True: TRL mixes the policy's weights into the reference's in place, and both rest "
                   "in outcore's tiers; leave it False.")
    return out


def kv_width(config: Any) -> int:
    """A Hugging Face config's key/value width: its key/value heads times their dimension (grouped
    query attention keeps fewer heads than the queries')."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return (getattr(config, "num_key_value_heads", None) or heads) * head_dim


def kv_bytes(*, layers: int, width: int, tokens: int, dtype: str) -> int:
    """The KV cache of one sequence of `tokens` tokens: a key and a value of the key/value width, each
    layer, each token, in the compute dtype (the Hugging Face cache's own)."""
    return 2 * layers * width * tokens * DTYPES[dtype][1]


def generation_note(engine: Engine, args: Any = None) -> str:
    """The start's line on generating: what of the model each `generate` keeps gathered, the bytes
    each new token reads of the rest (runtime/forward_cycle.py [Note: forward cycles]), and, from a
    TRL config `args`, the KV cache its generation batch's completions hold."""
    _, total = parameter_counts(engine)
    plan = engine.lifecycle.cycle.preview()
    stored = sum(u.stored_nbytes for u in engine.units)
    per_token = engine.lifecycle.cycle.streamed_bytes(plan)
    if per_token == 0:
        reads = "all of it stays in the budgets for a whole generate call, and a new token reads nothing"
    else:
        reads = (f"{human_bytes(stored - per_token)} of it stays in the budgets for a whole generate call, and "
                 f"each new token reads the other {human_bytes(per_token)} again (larger budgets keep more)")
    return (f"outcore: completions are generated through the engine ({total / 1e6:.1f}M parameters, "
            f"{human_bytes(stored)} stored): {reads}{_cache_words(engine, args)}; a batch's sequences share each "
            "read (README: GRPO)")


def _cache_words(engine: Engine, args: Any) -> str:
    """What the generation batch's KV cache holds for its completions, where `args` says the batch."""
    batch, tokens = getattr(args, "generation_batch_size", None), getattr(args, "max_completion_length", None)
    config = getattr(engine.model, "config", None)
    if not batch or not tokens or config is None or not hasattr(config, "num_hidden_layers"):
        return ""
    cache = batch * kv_bytes(layers=config.num_hidden_layers, width=kv_width(config), tokens=tokens,
                             dtype=engine.config.dtype)
    return (f"; a generation batch of {batch} sequences keeps a KV cache of {human_bytes(cache)} for their "
            f"{tokens} completion tokens, beside the budgets (outcore estimate --generate to size it)")
