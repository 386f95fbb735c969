"""The tensors autograd saves for backward outside the units, paged through the store.

With activation checkpointing (a model's own, or a train_batch's, runtime/vertical.py), what autograd
keeps from forward to backward is each checkpointed block's inputs and what the model's own code
between the blocks saves. Every such tensor of at least `PAGED_BYTES` is put in the store under an
`act.` key, in HOST (where it pages to NVMe under the same budgets as everything else) or straight
to NVMe, and is fetched back when backward needs it. Backward takes them in the reverse of the
order they were saved, so each fetch starts the next ones' reads (`PREFETCH_AHEAD` keys): the next
block's input comes off the disk while this block recomputes. A key is deleted when autograd lets go
of it (its graph node ran, or the graph was dropped unused). Parameters, and small tensors, stay
where they are. The bytes come back as they went (a copy each way): a paged run computes what an
unpaged one does, bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from outcore.offload import Tier, TieredStore

log = logging.getLogger("outcore.runtime.activations")

PAGED_BYTES = 1 << 16  # saved tensors below this stay in memory: the keys would cost more than they save
PREFETCH_AHEAD = 2  # keys read ahead of backward: the next block's input while this one recomputes


class SavedActivations:
    """Tensors autograd saves under `hooks()`, paged to `tier` (see the module docstring) once the
    first `in_place` bytes of them were kept where they are; with `tier` None, all kept and counted."""

    _said_kept = False  # the log says once per process that a tensor was too large to page

    def __init__(self, store: TieredStore, tier: Tier | None, is_parameter: Callable[[torch.Tensor], bool], *,
                 host_budget: int | None, in_place: int = 0) -> None:
        self.store, self.tier, self.is_parameter = store, tier, is_parameter
        self.in_place = in_place  # bytes still kept where they are before paging starts
        # A key may take a quarter of HOST, so that room for it can always be made by paging older
        # ones out; a larger tensor stays in memory, outside the budgets, and the log says so once.
        self.host_budget = host_budget
        self.largest = host_budget // 4 if tier is not None and host_budget is not None else None
        self._serial = 0
        self._lock = threading.RLock()  # a key's last handle may be freed on autograd's own thread
        self._users: dict[str, int] = {}  # live key -> handles autograd holds of it
        self._nbytes: dict[str, int] = {}
        self._order: list[str] = []  # keys as saved: backward wants them in reverse
        self._index: dict[str, int] = {}
        self._ahead: set[str] = set()  # keys a read from NVMe was started for (and counted)
        # one key for one tensor saved several times (a rotary table every block saves): id -> its
        # weak reference, its key and its version then (changed in place since: a new key)
        self._same: dict[int, tuple[weakref.ref, str, int]] = {}
        self.bytes_put = 0  # what was paged out, and of it what came back from NVMe
        self.bytes_from_nvme = 0
        self.bytes_kept = 0  # not paged: no tier, within `in_place`, or too large for the HOST budget

    @property
    def holds_keys(self) -> bool:
        """Whether any key of this pass is still in the store (autograd may still want it)."""
        with self._lock:
            return bool(self._users)

    def hooks(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        if torch.compiler.is_compiling():  # traced into a compiled graph: the graph keeps what it saves
            return t
        if t.nbytes < PAGED_BYTES or self.is_parameter(t) or t.layout is not torch.strided:
            return t
        if self.in_place >= t.nbytes:
            self.in_place -= t.nbytes
            self.bytes_kept += t.nbytes
            return t
        if self.tier is None or self.largest is None or t.nbytes > self.largest:
            self.bytes_kept += t.nbytes
            if self.largest is not None and not SavedActivations._said_kept:
                SavedActivations._said_kept = True
                log.warning("a saved activation of %s bytes is more than a quarter of the HOST budget (%s bytes), so "
                            "such tensors stay in memory outside the budgets instead of paging; raise host_budget to "
                            "page them", f"{t.nbytes:,}", f"{self.host_budget:,}")
            return t
        with self._lock:
            seen = self._same.get(id(t))
            if seen is not None and seen[0]() is t and seen[1] in self._users and seen[2] == t._version:
                key = seen[1]
            else:
                self._serial += 1
                key = f"act.{id(self)}.{self._serial}"
                self._same[id(t)] = (weakref.ref(t), key, t._version)
                self._index[key] = len(self._order)
                self._order.append(key)
                self.bytes_put += t.nbytes
                self.store.put(key, t.detach(), self.tier)
                self._users[key], self._nbytes[key] = 0, t.nbytes
            self._users[key] += 1
        packed = _Paged(key, t.device, t.nbytes)
        weakref.finalize(packed, self._let_go, key).atexit = False
        return packed

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Paged):
            return packed
        with self._lock:
            if packed.key not in self._ahead and self.store.tier_of(packed.key) == Tier.NVME:
                self._ahead.add(packed.key)  # (one read ahead was counted as it started)
                self.bytes_from_nvme += packed.nbytes
        self._read_ahead(packed.key)
        stored = self.store.fetch_now(packed.key, Tier.HOST)
        try:
            return stored.to(packed.device, copy=True)
        finally:
            self.store.release(packed.key)

    def _read_ahead(self, key: str) -> None:
        """Start reading the keys backward will want after `key`: those saved just before it."""
        with self._lock:
            at = self._index.get(key, 0)
            wanted = [k for k in reversed(self._order[max(0, at - PREFETCH_AHEAD):at])
                      if k in self._users and k not in self._ahead and self.store.tier_of(k) == Tier.NVME]
            if wanted:
                self._ahead.update(wanted)
                self.bytes_from_nvme += sum(self._nbytes[k] for k in wanted)
                self.store.prefetch(wanted, Tier.HOST)

    def _let_go(self, key: str) -> None:
        """Autograd freed one handle of `key`; the last one deletes it."""
        with self._lock:
            if key not in self._users:
                return
            self._users[key] -= 1
            if self._users[key] > 0:
                return
            self._forget(key)

    def _forget(self, key: str) -> None:
        del self._users[key], self._nbytes[key]
        self._ahead.discard(key)
        if key in self.store:
            self.store.delete(key)

    def clear(self) -> None:
        """Delete what a failed or abandoned pass left behind."""
        with self._lock:
            for key in list(self._users):
                self._forget(key)
            self._same.clear()


class _Paged:
    __slots__ = ("key", "device", "nbytes", "__weakref__")

    def __init__(self, key: str, device: torch.device, nbytes: int) -> None:
        self.key, self.device, self.nbytes = key, device, nbytes
