"""One fetch unit at run time: its flat parameter buffer, its shard keys, its two states.

[Note: unit states] SHARDED: only this rank's shard exists, in the store (key `u<i>.param`); the
flat buffer's storage has size 0, and the modules' parameter attributes hold stand-ins that refuse
to be read (runtime/released.py). UNSHARDED: the flat buffer holds the whole unit (gathered from
every rank's shard) and the modules' parameter attributes are views of it. `unshard()` and
`reshard()` are the only transitions (`alias_shard()` once, for an aliased unit), each asserting
the state it starts from; `refresh()` refills a resident unit in place. A *resident* unit never
reshards: stages 1 and 2 keep whole parameters, and a single rank whose parameters rest on DEVICE
aliases the flat buffer to the stored shard itself, so nothing is copied.

[Note: borrowed shards] With one rank the shard *is* the whole unit, so `unshard()` does not copy
it: the flat buffer's storage swaps memory with the store's buffer of the fetched shard
(runtime/storage_swap.py), and `reshard()` swaps it back and releases the key. The key
stays pinned while the unit is gathered, so the store neither moves nor frees that memory, and the
gathered unit is counted in the DEVICE budget instead of beside it. Meanwhile the store's own view
of the key is empty: nothing else may fetch or replace it (the engine updates a unit only after
releasing it).

The flat buffer is one autograd leaf for the whole unit: its storage is freed and refilled in
place (`untyped_storage().resize_`), so the views saved by autograd in forward are valid again
once backward re-gathers the unit.

[Note: unit gradients] The parameters' views come from one autograd function (`UnitViews`), and
its backward hands the parameters' own gradients to `on_gradient` rather than concatenating them
into a flat gradient for the leaf. With one rank and nothing to scale, the update then reads
those tensors in place (`gradient_pieces`): that saves a copy of every gradient into freshly
mapped memory each step (its cost on the reference GPT is in docs/benchmarks.md).
Several ranks, or a conversion or a scale, concatenate into one flat gradient as before.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from outcore.offload import Tier, TieredStore
from outcore.offload.aligned import advise_huge_pages
from outcore.runtime.collectives import Group, all_gather_chunk, reduce_scatter
from outcore.runtime.frozen_in_place import UnitSpans
from outcore.runtime.policy import StatePolicy, padded_numel
from outcore.runtime.quantized import QuantizedLayout
from outcore.runtime.released import ReleasedParameter
from outcore.runtime.storage_swap import swap_storage_memory
from outcore.runtime.unit_views import UnitViews, cut
from outcore.runtime.units import UnitPlan


class UnitState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDED = "unsharded"


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each parameter sits in the unit's flat buffer, and how the buffer is split."""

    offsets: tuple[int, ...]
    numel: int  # real parameters
    padded: int  # multiple of world x alignment
    shard: int  # padded // world

    @classmethod
    def of(cls, plan: UnitPlan, world: int, elem_size: int) -> Layout:
        offsets, n = [], 0
        for s in plan.slots:
            offsets.append(n)
            n += s.numel
        padded = padded_numel(n, world, elem_size)
        return cls(tuple(offsets), n, padded, padded // world)


@dataclass(frozen=True, slots=True, eq=False)
class Chunk:
    """Elements [start, end) of a unit's shard: the grain of optimizer streaming (DeepSpeed's
    sub-group). Each chunk has its own optimizer-state and gradient keys, so the HOST memory the
    optimizer pipeline needs is bounded by the chunk size, not by the largest unit. The parameter
    shard is one key per unit (`FlatUnit.param_key`), which one rank borrows whole."""

    unit: FlatUnit
    index: int
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    def slot_ranges(self) -> list[tuple[int, int, int]]:
        """The unit's parameters this chunk holds elements of: (slot index, start, end), the
        range within the chunk (padding is in none)."""
        lay = self.unit.layout
        begin = self.unit.group.rank * lay.shard + self.start  # the chunk's first element in the flat buffer
        out = []
        for i, (offset, slot) in enumerate(zip(lay.offsets, self.unit.plan.slots, strict=True)):
            a, b = max(offset, begin), min(offset + slot.numel, begin + self.numel)
            if a < b:
                out.append((i, a - begin, b - begin))
        return out

    @property
    def opt_key(self) -> str:
        return f"u{self.unit.index}.opt{self.index}"

    @property
    def grad_key(self) -> str:
        return f"u{self.unit.index}.grad{self.index}"


class FlatUnit:
    """A unit's flat parameters and the store keys of its shard's chunks."""

    def __init__(self, plan: UnitPlan, layout: Layout, policy: StatePolicy, device: torch.device,
                 group: Group, store: TieredStore) -> None:
        self.plan = plan
        self.index = plan.index
        self.layout = layout
        self.dtype = policy.torch_dtype
        self.device = device
        self.group = group
        self.store = store
        self.resident = policy.resident
        self.borrowing = policy.borrowing
        self.frozen = plan.frozen  # no gradient, no optimizer state: runtime/units.py [Note: frozen units]
        bounds = [] if self.frozen else policy.chunk_bounds(layout.shard)
        self.chunks = [Chunk(self, c, a, b) for c, (a, b) in enumerate(bounds)]
        self.param_key = f"u{self.index}.param"  # the whole shard, in the compute dtype
        # A frozen unit read where its weights lie: its spans of the weights files (runtime/frozen_in_place.py)
        self.in_place: UnitSpans | None = None
        # A frozen unit stored quantized: its bytes' layout (runtime/quantized.py [Note: quantized frozen units]),
        # and its spans of the unquantized files it was quantized from, what an export writes (`exported_values`)
        self.quantized: QuantizedLayout | None = None
        self._decodes_in_store = False
        self.original: UnitSpans | None = None
        self.state = UnitState.SHARDED
        self._borrowed: torch.UntypedStorage | None = None  # see [Note: borrowed shards]
        # One leaf for the life of the unit (hooks stay on it); its storage comes and goes.
        self.flat = torch.empty(layout.padded, dtype=self.dtype, device=device).requires_grad_(not self.frozen)
        self.flat.untyped_storage().resize_(0)
        self._aliased = False
        self.views_bound = False  # the modules' attributes are views of the flat buffer (else placeholders)
        self._placeholders = [ReleasedParameter(slot.shape, self.dtype, not slot.frozen, device,
                                                (slot.state_dict_names or ["?"])[0], self.name)
                              for slot in plan.slots]
        # fp32: the parameter shard is the master weights, and chunk states are [m|v] (runtime/optimizer.py).
        self.master_is_param = policy.master_is_param
        # Called with the parameters' gradients when backward has finished with the unit (runtime/hooks.py).
        self.on_gradient: Callable[[list[torch.Tensor | None]], None] | None = None
        self.wait_seconds = 0.0  # time spent waiting for the store

    @property
    def is_gathered(self) -> bool:
        return self.state is UnitState.UNSHARDED

    @property
    def aliased(self) -> bool:
        """The flat buffer is the stored shard itself (not a gathered copy)."""
        return self._aliased

    @property
    def decodes_in_store(self) -> bool:
        """One rank, quantized: decoded into memory the store lends (`_borrow_decoded`)."""
        return self._decodes_in_store

    @property
    def gathered_nbytes(self) -> int:
        """Bytes of the whole unit's parameters, gathered."""
        return self.layout.padded * self.flat.element_size()

    @property
    def stored_nbytes(self) -> int:
        """Bytes of this rank's stored shard (a quantized unit's codes and scales)."""
        return self.quantized.shard if self.quantized is not None else self.layout.shard * self.flat.element_size()

    @property
    def name(self) -> str:
        return (self.plan.name or "<root>") + (" (frozen)" if self.frozen else "")

    def store_quantized(self, layout: QuantizedLayout) -> None:
        """From now on the unit's shard is `layout`'s bytes, decoded at every gather: it is never
        resident and never borrows the stored shard (runtime/quantized.py). With one rank it is
        decoded into DEVICE memory the store lends it instead, so that its values count in the
        device budget as a borrowed shard's do (`_borrow_decoded`)."""
        assert self.frozen and self.state is UnitState.SHARDED
        self.quantized = layout
        self._decodes_in_store = self.borrowing
        self.resident = self.borrowing = False

    def alias_shard(self) -> None:
        """World 1, parameters on DEVICE: the flat buffer *is* the stored shard (pinned for good).
        With `master_is_param` the fused update then writes the live parameters, nothing copied."""
        assert self.group.world == 1 and self.resident and len(self.chunks) == (0 if self.frozen else 1)
        assert self.state is UnitState.SHARDED, f"{self.name}: already gathered"
        shard = self.store.fetch_now(self.param_key, Tier.DEVICE)
        self.flat = shard.detach().requires_grad_(not self.frozen)
        self._aliased = True
        self.state = UnitState.UNSHARDED

    def unshard(self, tier: Tier = Tier.DEVICE) -> None:
        """Gather every rank's shard into the flat buffer (allowed from SHARDED only); a borrowing
        unit borrows from `tier` (HOST: a CPU's, where both tiers are RAM)."""
        assert self.state is UnitState.SHARDED, f"{self.name}: unshard() of a gathered unit"
        if self.borrowing or self._decodes_in_store:
            if self._decodes_in_store:
                self._borrow_decoded(tier)
            else:
                self._borrow(tier)
            self.state = UnitState.UNSHARDED
            return
        storage = self.flat.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.layout.padded * self.flat.element_size())
            if self.device.type == "cpu":  # refilled every step: fault it in 2 MiB pages, not 4 KiB
                advise_huge_pages(storage.data_ptr(), storage.nbytes())
        # Refilling is not a change autograd must see: the views it saved are meant to read these
        # same values again in backward.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.flat):
            self._gather_into(self.flat)
        self.state = UnitState.UNSHARDED

    def _fetch_shard(self, tier: Tier = Tier.DEVICE) -> torch.Tensor:
        t0 = time.perf_counter()
        shard = self.store.fetch_now(self.param_key, tier)
        self.wait_seconds += time.perf_counter() - t0
        return shard

    def _borrow(self, tier: Tier) -> None:
        """World 1: the flat buffer takes the fetched shard's memory; see [Note: borrowed shards]."""
        shard = self._fetch_shard(tier)
        storage = shard.untyped_storage()
        assert shard.storage_offset() == 0 and storage.nbytes() >= self.layout.padded * self.flat.element_size()
        swap_storage_memory(self.flat.untyped_storage(), storage)
        self._borrowed = storage

    @property
    def decoded_key(self) -> str:
        return f"u{self.index}.decoded"  # a quantized unit's values while gathered (one rank)

    def _borrow_decoded(self, tier: Tier) -> None:
        """One rank, a quantized unit: decoded into DEVICE memory the store lends under a key of its
        own (pinned while gathered, forgotten at `reshard()`), borrowed as in [Note: borrowed shards]."""
        staged = self.store.stage(self.decoded_key, (self.layout.padded,), self.dtype, tier)
        try:
            with torch.no_grad():
                self._gather_into(staged.tensor)
        except BaseException as e:
            staged.abort(e)
            raise
        staged.commit()
        decoded = self.store.fetch_now(self.decoded_key, tier)
        storage = decoded.untyped_storage()
        assert decoded.storage_offset() == 0 and storage.nbytes() >= self.layout.padded * self.flat.element_size()
        swap_storage_memory(self.flat.untyped_storage(), storage)
        self._borrowed = storage

    def _gather_into(self, full: torch.Tensor) -> None:
        """Every rank's shard of the unit into `full` (a quantized unit's bytes gathered, then decoded)."""
        piece = self._fetch_shard()
        try:
            if self.quantized is None:
                all_gather_chunk(full, piece, self.layout.shard, 0, self.layout.shard, self.group)
                return
            raw = piece
            if self.group.world > 1:
                raw = torch.empty(self.quantized.padded, dtype=torch.uint8, device=piece.device)
                all_gather_chunk(raw, piece, self.quantized.shard, 0, self.quantized.shard, self.group)
            self.quantized.decode_into(raw, full, self.layout.offsets, self.plan.slots)
        finally:
            self.store.release(self.param_key)

    @property
    def borrowed(self) -> bool:
        """Gathered by borrowing the store's buffer: its bytes are counted in the DEVICE budget."""
        return self._borrowed is not None

    def reshard(self) -> None:
        """Free the full parameters (allowed from UNSHARDED only; never for resident units)."""
        assert self.state is UnitState.UNSHARDED and not self.resident, f"{self.name}: cannot reshard"
        if self._borrowed is not None:
            # The store's buffer gets its memory back.
            swap_storage_memory(self.flat.untyped_storage(), self._borrowed)
            self._borrowed = None
            if self._decodes_in_store:
                self.store.release(self.decoded_key)
                self.store.delete(self.decoded_key)
            else:
                self.store.release(self.param_key)
        else:
            self.flat.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED
        self.release_views()

    def release(self) -> None:
        """`reshard()` where there is something to let go: a gathered unit that is not resident."""
        if self.state is UnitState.UNSHARDED and not self.resident:
            self.reshard()

    def bind_views(self) -> list[torch.Tensor]:
        """Point every module attribute of the unit's parameters at new views of the flat buffer
        (one autograd node, whose backward is the unit's gradient callback); returns them."""
        assert self.state is UnitState.UNSHARDED
        pieces = UnitViews.apply(self.flat, self)
        views = [piece.view(slot.shape) for slot, piece in zip(self.plan.slots, pieces, strict=True)]
        self.point_at(views)
        return views

    def point_at(self, views: list[torch.Tensor]) -> None:
        """Point the module attributes at `views`, made by `bind_views` while the unit is gathered."""
        assert self.state is UnitState.UNSHARDED
        for slot, view in zip(self.plan.slots, views, strict=True):
            for module, name in slot.places:
                setattr(module, name, view)
        self.views_bound = True

    def mark_closed(self) -> None:
        """The engine closed: its stand-ins, read from now on, say that the values are gone for good."""
        for placeholder in self._placeholders:
            placeholder.engine_closed = True

    def release_views(self) -> None:
        """Point every module attribute of the unit's parameters at its `ReleasedParameter`: a view
        left there would read memory the flat buffer no longer has (runtime/released.py)."""
        for slot, placeholder in zip(self.plan.slots, self._placeholders, strict=True):
            for module, name in slot.places:
                setattr(module, name, placeholder)
        self.views_bound = False

    def gradient_pieces(self, grads: list[torch.Tensor | None], factor: float, *,
                        keep: bool) -> list[list[torch.Tensor]]:
        """This rank's fp32 gradient shard times `factor`, chunk by chunk, each chunk as flat pieces
        that together cover its elements in order; see [Note: unit gradients].

        `grads` are the parameters' gradients in slot order (None: no gradient, read as zeros).
        With one rank, fp32 gradients and `factor == 1` the pieces are views of those tensors, which
        may alias one another: read them, never write them. Otherwise they are views of one new
        shard, which `keep` makes sure holds no more memory than the shard itself.
        """
        flats = self._flat_gradients(grads)
        if self.group.world == 1 and factor == 1.0 and self.dtype == torch.float32:
            offsets = [*self.layout.offsets, self.layout.numel]
            return [cut(flats, offsets, c.start, c.end) for c in self.chunks]
        full = torch.cat(flats)
        full = full if full.dtype == torch.float32 else full.float()
        shard = reduce_scatter(full, self.group)
        if factor != 1.0:
            shard.mul_(factor)
        if keep and shard.untyped_storage().nbytes() > shard.nbytes:  # gloo's shard is a view of the whole
            shard = shard.clone()
        return [[shard[c.start : c.end]] for c in self.chunks]

    def _flat_gradients(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Each parameter's gradient flattened (zeros for None), then zeros for the padding."""
        flats = [torch.zeros(slot.numel, dtype=self.dtype, device=self.device) if g is None else g.reshape(-1)
                 for g, slot in zip(grads, self.plan.slots, strict=True)]
        flats.append(torch.zeros(self.layout.padded - self.layout.numel, dtype=self.dtype, device=self.device))
        return flats

    def refresh(self) -> None:
        """After an update: refill a resident unit's whole parameters from the updated shards, in
        place (it stays UNSHARDED; the views autograd holds read the new values)."""
        assert self.resident and self.state is UnitState.UNSHARDED, f"{self.name}: refresh() of a non-resident unit"
        if self._aliased:
            return  # the update wrote into the shard, which is the flat buffer
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.flat):
            self._gather_into(self.flat)

    def exported_values(self) -> torch.Tensor:
        """What an export writes of the unit: a quantized unit's original weights where it was quantized
        from files that hold them (its codes only approximate them), else `full_values()`."""
        if self.original is None:
            return self.full_values()
        full = torch.empty(self.layout.padded, dtype=self.dtype)
        self.original.source(0, self.layout.padded).read_into(full)
        return full

    def full_values(self) -> torch.Tensor:
        """The whole unit's parameters gathered into a new buffer (for state dicts and export)."""
        if self._aliased or self.state is UnitState.UNSHARDED:
            return self.flat.detach().clone()
        full = torch.empty(self.layout.padded, dtype=self.dtype, device=self.device)
        self._gather_into(full)
        return full

