"""A speculative update that clipping invalidates, done again (runtime/update_stream.py [Note:
speculative clipping]).

The speculation changed three things in place: the unit's parameter shard, and each chunk's two
moments. The moments were kept aside (`TieredStore.keep`). The parameter shard was kept only where
that cost nothing (for a failed pass), so what the update did to it is taken back from the new
moments, always, for the same bits whichever shards were kept: AdamW moved each parameter by
`lr / bc1 * m' / (sqrt(v' / bc2) + eps)` after scaling it by `1 - lr * weight_decay`, so adding
that back and dividing finds the old parameter to within an ulp or two. The gradient comes back
from the two first moments, m' = m + (1 - beta1)(g - m) (torch.lerp's form, which the fused kernel
computes), also to within a few ulps; scaled by the clip coefficient, it is applied again from the
old moments.
"""

from __future__ import annotations

import math

import torch

from outcore.offload import TieredStore
from outcore.runtime.flat_unit import Chunk, FlatUnit
from outcore.runtime.optimizer import AdamW, ParamWriter, update_chunks
from outcore.runtime.policy import Placement
from outcore.runtime.step_counts import StepCounts


def redo_clipped(unit: FlatUnit, store: TieredStore, place: Placement, hp: AdamW, counts: StepCounts, *,
                 lr: float, coef: float, idle: frozenset[int]) -> None:
    """Undo `unit`'s speculative update and apply it again with the gradient scaled by `coef`;
    its step counts are those the speculation ran with (not advanced yet)."""
    beta1, work = hp.betas[0], place.work_tier
    if store.is_kept(unit.param_key):  # kept for a failed pass; a redo takes it back the one way
        store.drop_kept(unit.param_key)
    with ParamWriter(store, place) as params:
        for c in unit.chunks:
            new = store.fetch_now(c.opt_key, work)
            try:
                m_new, v_new = new.chunk(2)
                undo_update(c, params.master(c), m_new, v_new, hp, counts, lr=lr, idle=idle)
                grad = m_new.clone()
            finally:
                store.release(c.opt_key)
            store.restore_kept(c.opt_key)
            old = store.fetch_now(c.opt_key, work)
            try:
                m = old[: c.numel]
                grad.sub_(m).div_(1.0 - beta1).add_(m).mul_(coef)
            finally:
                store.release(c.opt_key)
            update_chunks([c], store, place, hp, params, counts, lr=lr, grad_scale=1.0, grads=[[grad]],
                          idle={unit.index: idle})


def undo_update(chunk: Chunk, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hp: AdamW,
                counts: StepCounts, *, lr: float, idle: frozenset[int]) -> None:
    """Take an AdamW update back from `master` in place, given the moments it left (`m`, `v`):
    parameter by parameter, each with the step count and weight decay it was updated with; those
    that sat the update out (`idle`) are left as they are."""
    beta1, beta2 = hp.betas
    unit = chunk.unit.index
    decays = hp.decays(chunk) if hp.no_decay else None
    for slot, a, b in chunk.slot_ranges():
        if slot in idle:
            continue
        step = counts.of(unit, slot) + 1
        decay = hp.weight_decay if decays is None else decays[slot]
        denom = v[a:b].sqrt().div_(math.sqrt(1.0 - beta2**step)).add_(hp.eps)
        master[a:b].addcdiv_(m[a:b], denom, value=lr / (1.0 - beta1**step)).div_(1.0 - lr * decay)
