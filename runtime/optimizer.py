"""AdamW on fp32 master shards, streamed unit by unit through the store.

[Note: optimizer state] Each chunk of a unit's shard keeps its fp32 optimizer state under one key:
`[exp_avg | exp_avg_sq]` when the unit's fp32 parameter shard is its master (fp32 training; see
`StatePolicy.master_is_param`), `[master | exp_avg | exp_avg_sq]` when the parameters are
bf16 or fp16. Reading and writing a chunk is then one large sequential request each, and the
pipeline holds a few chunks, never a whole large unit. The update is `torch._fused_adamw_`, the
kernel behind `torch.optim.AdamW(fused=True)`: bias correction and decoupled weight decay exactly
as torch.optim.AdamW computes them. The caller keeps the step counts (runtime/step_counts.py) and
advances a unit's once all of its chunks are updated (runtime/update_stream.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from outcore.offload import Tier, TieredStore
from outcore.offload.store import StagedPut
from outcore.runtime.flat_unit import Chunk
from outcore.runtime.hyperparameters import check_hyperparameters
from outcore.runtime.policy import Placement
from outcore.runtime.step_counts import StepCounts
from outcore.runtime.stochastic_rounding import StochasticRounding


@dataclass
class AdamW:
    """Hyper-parameters of AdamW (the same defaults as torch.optim.AdamW). `no_decay` names the
    parameters (as `model.named_parameters()` names them; a tied one by any of its names) that take
    no weight decay: a second parameter group of weight_decay 0, as transformers' Trainer makes
    for biases and norm weights."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    no_decay: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        check_hyperparameters({k: v for k, v in dataclasses.asdict(self).items() if k != "no_decay"}, "AdamW")
        self.lr, self.eps, self.weight_decay = float(self.lr), float(self.eps), float(self.weight_decay)
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        if isinstance(self.no_decay, str) or not all(isinstance(n, str) for n in self.no_decay):
            raise ValueError("AdamW.no_decay: give a set of parameter names, e.g. {'norm.weight', 'head.bias'}.")
        self.no_decay = frozenset(self.no_decay)

    def decays(self, chunk: Chunk) -> list[float]:
        """The weight decay of each parameter of the chunk's unit, by slot index."""
        return [0.0 if self.no_decay.intersection(slot.state_dict_names) else self.weight_decay
                for slot in chunk.unit.plan.slots]


@dataclass
class _Group:
    """The lists of one fused AdamW call: the chunk pieces that share a weight decay."""

    masters: list[torch.Tensor] = dataclasses.field(default_factory=list)
    grads: list[torch.Tensor] = dataclasses.field(default_factory=list)
    exp_avgs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    steps: list[torch.Tensor] = dataclasses.field(default_factory=list)


def initial_state(master: torch.Tensor, *, with_master: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A new chunk's state in `dtype`: [0 | 0], or [master | 0 | 0] `with_master`."""
    n = master.numel()
    state = torch.zeros((3 if with_master else 2) * n, dtype=dtype)
    if with_master:
        state[:n].copy_(master)
    return state


def update_chunks(chunks: list[Chunk], store: TieredStore, place: Placement, hp: AdamW, params: ParamWriter,
                  counts: StepCounts, *, lr: float, grad_scale: float,
                  grads: list[list[torch.Tensor]] | None = None,
                  idle: Mapping[int, frozenset[int]] | None = None,
                  rounding: StochasticRounding | None = None) -> None:
    """Read the chunks' states and gradients, update them in one fused call, write the states back
    and drop the gradients.

    Streaming from HOST or NVMe passes one chunk at a time (the store prefetches the next ones);
    states resident on DEVICE go all at once, as torch.optim.AdamW(fused=True) does.
    `grad_scale` multiplies the gradients first (the global-norm clip coefficient, 1.0 for none).
    `params` lends the masters that are parameter shards and takes the others' new values.
    `counts`: the updates each unit, and each of its parameters, took before this one.
    `idle`: by unit index, the slots that got no gradient this step, which sit this update out
    (runtime/step_counts.py).
    `grads`: the chunks' gradients handed over in memory, each chunk's as flat pieces covering it in
    order (`FlatUnit.gradient_pieces`; read only); without them they are read from the store (and
    dropped from it after the update).
    `rounding`: the states are bf16 (`Config.state_dtype`): each chunk's are updated in fp32 copies
    and rounded back stochastically (runtime/stochastic_rounding.py).
    """
    stored = grads is None
    assert stored or grad_scale == 1.0, "handed-over gradients may alias one another: never scaled in place"
    fetched: list[tuple[str, bool]] = []  # (key, changed): released whatever happens

    def fetch(key: str, *, changed: bool) -> torch.Tensor:
        t = store.fetch_now(key, place.work_tier)
        fetched.append((key, changed))
        return t

    try:
        states = [fetch(c.opt_key, changed=True) for c in chunks]
        if grads is None:
            grads = [[fetch(c.grad_key, changed=False)] for c in chunks]
        masters: list[torch.Tensor] = []
        groups: dict[float, _Group] = {}  # by weight decay
        rounded: list[tuple[torch.Tensor, torch.Tensor]] = []  # (bf16 storage, its fp32 copy)
        for c, st, parts in zip(chunks, states, grads, strict=True):
            if c.unit.master_is_param:
                master = params.master(c)
                m, v = st.chunk(2)
            else:
                master, m, v = st.chunk(3)
            masters.append(master)
            if rounding is not None:  # fp32 copies of what is stored in bf16 (an fp32 master is its own)
                assert len(chunks) == 1, "bf16 states are updated a chunk at a time (runtime/update_stream.py)"
                copies = [rounding.widen(t, slot) if t.dtype == torch.bfloat16 else t
                          for slot, t in enumerate((master, m, v))]
                rounded += [(t, w) for t, w in zip((master, m, v), copies, strict=True) if t is not w]
                master, m, v = copies
            unit, sitting_out = c.unit.index, (idle or {}).get(c.unit.index, frozenset())
            decays = hp.decays(c) if hp.no_decay else None
            ranges = c.slot_ranges() if decays is not None else []
            one_decay = decays is None or len({decays[slot] for slot, _, _ in ranges}) == 1
            if counts.uniform(unit) and not sitting_out and one_decay:
                # The states are cut where the gradient's pieces are: one fused call takes them all.
                g = groups.setdefault(hp.weight_decay if decays is None else decays[ranges[0][0]], _Group())
                sizes = [p.numel() for p in parts]
                for t, out in ((master, g.masters), (m, g.exp_avgs), (v, g.exp_avg_sqs)):
                    out.extend(t.split(sizes) if len(parts) > 1 else [t])
                g.grads.extend(parts)
                step = torch.tensor(float(counts.units[unit] + 1), dtype=torch.float32, device=st.device)
                g.steps.extend([step] * len(parts))
                continue
            # Parameter by parameter, each with its own step count and weight decay; those without a
            # gradient left out.
            grad = parts[0] if len(parts) == 1 else torch.cat(parts)
            for slot, a, b in ranges or c.slot_ranges():
                if slot not in sitting_out:
                    g = groups.setdefault(hp.weight_decay if decays is None else decays[slot], _Group())
                    for t, out in ((master, g.masters), (m, g.exp_avgs), (v, g.exp_avg_sqs), (grad, g.grads)):
                        out.append(t[a:b])
                    g.steps.append(torch.tensor(float(counts.of(unit, slot) + 1), dtype=torch.float32,
                                                device=st.device))
        if grad_scale != 1.0 and groups:
            torch._foreach_mul_([t for g in groups.values() for t in g.grads], grad_scale)
        for weight_decay, g in groups.items():  # none: every parameter of these chunks sits this update out
            torch._fused_adamw_(g.masters, g.grads, g.exp_avgs, g.exp_avg_sqs, [], g.steps, lr=lr,
                                beta1=hp.betas[0], beta2=hp.betas[1], weight_decay=weight_decay, eps=hp.eps,
                                amsgrad=False, maximize=False)
        for storage, updated in rounded:
            assert rounding is not None
            rounding.round_into(storage, updated)
        for c, master in zip(chunks, masters, strict=True):
            params.write(c, master)
    finally:
        # Optimizer states put with `return_home` when written back after each update
        # (`Placement.opt_returns_home`): the store then sends them to NVMe in the background, and
        # HOST is free for the next chunk.
        for key, changed in fetched:
            store.release(key, dirty=changed)
    if stored:
        for c in chunks:  # spent: its memory is free for the next chunk's, and it is never written back
            store.delete(c.grad_key)


# [Note: updated parameters stay put]
# Parameters resting on NVMe are cached in memory, and after an in-place update a shard stays in
# the tier the update found it in (on a CPU, DEVICE, where backward left it), written back only
# when the store evicts it. Backward updates the units the next forward runs first last, so
# those are still in memory when it asks for them: neither written nor read back in between.
# Moving them to HOST instead, as this once did, filled the tier the optimizer states stream
# through, so each was written out and read back every step (134M GPT, 256 MiB budgets: 1.5 GiB
# read a step against 1.25 GiB now).


class ParamWriter:
    """A pass that changes units' parameter shards, chunk by chunk, each unit under its one key.

    Two ways, per unit:
    - in place (`master`): a unit whose fp32 parameter shard is its master lends it, fetched to
      the work tier at the unit's first chunk (or the live flat buffer, when aliased), and it is
      released, changed, with the unit's last chunk;
    - a new shard: otherwise (and always when `in_place=False`, as loading a checkpoint wants)
      the new shard is staged in its tier (`TieredStore.stage`) at the unit's first chunk, filled
      as each chunk's values arrive (converted to the compute dtype in the copy) and committed with
      its last chunk.
    Every chunk of a unit passes through `write`, in order. Used as a context manager: if the pass
    fails, a staged shard not yet whole is given up (the unit keeps its old parameters, and fetches
    of it wait for the commit or the abort, never hang), and a lent one is released as it stands.
    """

    def __init__(self, store: TieredStore, place: Placement, *, in_place: bool = True) -> None:
        self.store = store
        self.place = place
        self.in_place = in_place
        self._staged: dict[str, tuple[StagedPut, int]] = {}  # parameter key -> (staged put, chunks left)
        self._lent: dict[str, tuple[torch.Tensor, int]] = {}  # parameter key -> (fetched shard, chunks left)

    def master(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's slice of its unit's parameter shard, to update in place."""
        unit = chunk.unit
        assert self.in_place and unit.master_is_param
        if unit.aliased:  # the stored shard is the live flat buffer
            return unit.flat.detach()[chunk.start : chunk.end]
        key = unit.param_key
        if key not in self._lent:
            tier = self.store.ram_tier_of(key) or self.place.work_tier  # on a CPU, updated where it rests
            self._lent[key] = (self.store.fetch_now(key, tier), len(unit.chunks))
        return self._lent[key][0][chunk.start : chunk.end]

    def write(self, chunk: Chunk, master: torch.Tensor) -> None:
        """The chunk's new parameter values are `master` (in place: already written)."""
        unit = chunk.unit
        if self.in_place and unit.master_is_param:
            if not unit.aliased and _count_down(self._lent, unit.param_key) is not None:
                # Resting in HOST, the store sends it back there (its `return_home` hint; a CPU: no
                # copy); resting on NVMe, it stays where the update found it, dirty, until the store
                # needs the room: see [Note: updated parameters stay put].
                self.store.release(unit.param_key, dirty=True)
            return
        if unit.aliased:  # the stored shard is the live flat buffer: update it in place
            with torch.no_grad():
                unit.flat[chunk.start : chunk.end].copy_(master)
            return
        if unit.param_key not in self._staged:
            # Parameters resting on NVMe are put in HOST, dirty: while there is room the next forward
            # reads them from memory, and only eviction under pressure writes them to the swap file.
            tier = Tier.HOST if self.place.param_tier == Tier.NVME else self.place.param_tier
            staged = self.store.stage(unit.param_key, (unit.layout.shard,), unit.dtype, tier,
                                      return_home=self.place.param_returns_home)
            self._staged[unit.param_key] = (staged, len(unit.chunks))
        staged = self._staged[unit.param_key][0]
        staged.tensor[chunk.start : chunk.end].copy_(master)
        if _count_down(self._staged, unit.param_key) is not None:
            staged.commit()

    def __enter__(self) -> ParamWriter:
        return self

    def __exit__(self, kind, error, _tb) -> None:
        for staged, _ in self._staged.values():
            staged.abort(error or RuntimeError("the update pass ended before these units were whole"))
        self._staged.clear()
        for key in self._lent:  # updated in place up to where the pass stopped, as their states were
            self.store.release(key, dirty=True)
        self._lent.clear()


def _count_down(table: dict, key: str):
    """One more chunk of `key` is done: its value once that was the last chunk, else None."""
    value, left = table.pop(key)
    if left > 1:
        table[key] = (value, left - 1)
        return None
    return value
