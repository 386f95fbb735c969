"""`outcore estimate`: bytes per tier per rank, before buying hardware or launching a run.

The numbers come from `runtime.memory_plan`, the same function the engine sizes its budgets with,
applied to the unit sizes of the model: exact for a preset or a `module:factory` (built on the meta
device), a GPT of about that size for `--params`.
"""

from __future__ import annotations

import math

from outcore.runtime.memory_plan import MemoryPlan, plan_memory, unit_shapes
from outcore.runtime.policy import DTYPES, OFFLOADS, StatePolicy
from outcore.runtime.quantized import bytes_per_weight


def legal_settings(stage: int | None = None, offload_params: str | None = None,
                   offload_optimizer: str | None = None) -> list[tuple[int, str, str]]:
    """Every (stage, offload_params, offload_optimizer) the engine accepts, filtered by the given ones."""
    out = []
    for st in (1, 2, 3):
        for op in OFFLOADS if st == 3 else ("none",):  # parameter offload needs stage 3
            for oo in OFFLOADS:
                if (stage in (None, st) and offload_params in (None, op) and offload_optimizer in (None, oo)):
                    out.append((st, op, oo))
    return out


def estimate(unit_numels: list[int], *, world: int = 1, dtype: str = "bf16", state_dtype: str = "fp32", stage: int = 3,
             offload_params: str = "none", offload_optimizer: str = "none", prefetch_depth: int = 2,
             sub_group_size: int = 1 << 22, grad_clip: float | None = 1.0, device: str = "cuda",
             grad_accumulation: int = 1, frozen: list[bool] | None = None, roots: list[bool] | None = None,
             modules: list[int] | None = None, outer: list[bool] | None = None,
             frozen_in_files: bool = False, stored: list[int | None] | None = None) -> MemoryPlan:
    """Per-rank bytes per tier for units of these sizes (parameters per unit, root unit last, or as
    `roots` says; `frozen` units have no gradient or optimizer state, `modules` pairs a unit with
    its frozen sibling, `outer` marks large modules outside the blocks: `unit_layout` in
    tools/model_source.py gives all five for a real model).
    Without clipping (and not fp16) the engine updates each unit during backward, so gradients of
    one unit at a time are held instead of all of them. `device`: "cuda" or "cpu" (DEVICE is RAM too,
    and the whole prefetch window is on it). `frozen_in_files`: frozen units on NVMe are read from
    the model's weights files, not the swap file (a LoRA base: runtime/frozen_in_place.py). `stored`:
    a unit's shard in bytes where it is not its elements' (a quantized base: `quantized_stored`)."""
    policy = StatePolicy(world=world, stage=stage, offload_params=offload_params,
                         offload_optimizer=offload_optimizer, dtype=dtype, device_type=device,
                         prefetch_depth=prefetch_depth, sub_group_size=sub_group_size,
                         clipping=grad_clip is not None, grad_accumulation=grad_accumulation,
                         state_dtype=state_dtype)
    plan = plan_memory(unit_shapes(unit_numels, policy, frozen=frozen, roots=roots, modules=modules, outer=outer,
                                   stored=stored), policy, frozen_in_files=frozen_in_files)
    return plan.at_default_budgets()


def quantized_stored(unit_numels: list[int], layout: dict, world: int, kind: str, double: bool) -> list[int | None]:
    """Each unit's stored shard bytes under `Config.quantize` (runtime/quantized.py): the frozen units
    of the blocks quantized whole (their norms are a rounding error), the root's and the large modules
    outside the blocks (embeddings, the head) left in the compute dtype; None for the others."""
    per = bytes_per_weight(kind, double)
    frozen = layout.get("frozen") or [False] * len(unit_numels)
    roots = layout.get("roots") or [i == len(unit_numels) - 1 for i in range(len(unit_numels))]
    outer = layout.get("outer") or [False] * len(unit_numels)
    return [math.ceil(n / world * per) if f and not r and not o else None
            for n, f, r, o in zip(unit_numels, frozen, roots, outer, strict=True)]


def hf_dims(config) -> tuple[int, int, int, int]:
    """A Hugging Face config's layers, width, vocabulary and context length (for
    `train_batch_activations`)."""
    return (config.num_hidden_layers, config.hidden_size, config.vocab_size,
            getattr(config, "max_position_embeddings", 2048))


def train_batch_activations(*, layers: int, d_model: int, vocab: int, batch: int, seq: int, micro_batches: int,
                            dtype: str = "bf16") -> int:
    """Bytes of activation keys a `train_batch` of `micro_batches` keeps per rank (runtime/vertical.py):
    for every micro-batch, each block's input, and what a GPT's code outside the blocks saves for
    backward: the final norm's and the head's inputs, and the logits' log-softmax (fp32, as the loss
    computes it; saved by two operations, paged once). They page through HOST and NVMe."""
    elem = DTYPES[dtype][1]
    per_micro = batch * seq * ((layers + 2) * d_model * elem + vocab * 4)
    return micro_batches * per_micro


def estimate_table(unit_numels: list[int], settings: list[tuple[int, str, str]], **kw) -> list[dict]:
    rows = []
    for st, op, oo in settings:
        plan = estimate(unit_numels, stage=st, offload_params=op, offload_optimizer=oo, **kw)
        rows.append({"stage": st, "offload_params": op, "offload_optimizer": oo, **plan.as_dict(),
                     "device_min": plan.device_min, "host_min": plan.host_min})
    return rows

