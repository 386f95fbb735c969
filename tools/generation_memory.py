"""What generating holds beside the budgets, for `outcore estimate --generate TOKENS`: the KV cache.

GRPO and RLOO generate a whole generation batch (prompts x num_generations) in one `generate` call,
so that each unit's bytes, read once a decoding step, serve every sequence. The batch is bounded by
the KV cache, the model's own (the Hugging Face cache), which lives in the compute device's memory
beside the store's budgets: each layer keeps a key and a value of its key/value width for every
token of every sequence, in the compute dtype. A decoding step's other tensors are a token's
(the prefill's logits are kept for the last position only), small beside it.
"""

from __future__ import annotations

from outcore.hf.generation import kv_bytes
from outcore.runtime.sizes import human_bytes


def generation_lines(*, layers: int, width: int, tokens: int, dtype: str, room: int, where: str
                     ) -> tuple[dict[str, int], list[str]]:
    """The cache of one sequence of `tokens` tokens, and the largest generation batch whose cache
    fits in `room` bytes (of `where`), with what to say of them."""
    one = kv_bytes(layers=layers, width=width, tokens=tokens, dtype=dtype)
    batch = max(0, room) // one
    said = (f"generation: a sequence of {tokens:,} tokens (prompt and completion) holds a KV cache of "
            f"{human_bytes(one)} ({layers} layers x key and value of width {width}, {dtype}); ")
    if batch < 1:
        said += (f"not even one fits in the {human_bytes(max(room, 0))} the budgets leave of {where}: lower the "
                 "tokens or the budgets")
    else:
        said += (f"a generation batch (prompts x num_generations) of up to {batch:,} fits in the "
                 f"{human_bytes(room)} the budgets leave of {where} (its cache {human_bytes(batch * one)})")
    return {"tokens": tokens, "kv_bytes_per_sequence": one, "batch": batch, "room": room}, [said]
