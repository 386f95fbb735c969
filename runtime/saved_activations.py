"""The activations a train_batch keeps between units, paged through the store (runtime/vertical.py).

What this keeps is each unit's inputs for each micro-batch: every unit is checkpointed (its
forward recomputed in backward; torch's non-reentrant checkpoint), and every tensor that autograd
saves outside the units (those inputs, and what the model's own code between units saves) that
is at least `PAGED_BYTES` is put in the store under an `act.` key, in HOST, so that it pages to
NVMe under the same budgets as everything else, and is fetched back (and deleted) when backward
needs it. Parameters, and small tensors, stay where they are.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from outcore.offload import Tier, TieredStore

log = logging.getLogger("outcore.runtime.vertical")

PAGED_BYTES = 1 << 16  # saved tensors below this stay in memory: the keys would cost more than they save


class SavedActivations:
    """Tensors autograd saves outside the units, paged through the store (see the module docstring)."""

    _said_kept = False  # the log says once per process that a tensor was too large to page

    def __init__(self, store: TieredStore, work_tier: Tier, is_parameter: Callable[[torch.Tensor], bool], *,
                 host_budget: int | None) -> None:
        self.store, self.work_tier, self.is_parameter = store, work_tier, is_parameter
        # A key may take a quarter of HOST, so that room for it can always be made by paging older
        # ones out; a larger tensor stays in memory, outside the budgets, and the log says so once.
        # None: nothing pages (an engine that offloads nothing and was given no HOST budget keeps
        # its activations where they are, as plain accumulation does).
        self.host_budget = host_budget
        self.largest = host_budget // 4 if host_budget is not None else None
        self._serial = 0
        self._lock = threading.Lock()
        self.live: set[str] = set()
        self.bytes_put = 0  # what was paged out, and of it what came back from NVMe
        self.bytes_from_nvme = 0
        self.bytes_kept = 0  # too large for the HOST budget: kept in memory

    def hooks(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        if t.nbytes < PAGED_BYTES or self.is_parameter(t) or t.layout is not torch.strided:
            return t
        if self.largest is None or t.nbytes > self.largest:
            self.bytes_kept += t.nbytes
            if self.largest is not None and not SavedActivations._said_kept:
                SavedActivations._said_kept = True
                log.warning("train_batch: a saved activation of %s bytes is more than a quarter of the HOST budget "
                            "(%s bytes), so such tensors stay in memory outside the budgets instead of paging; set "
                            "host_budget to page them", f"{t.nbytes:,}", f"{self.host_budget:,}")
            return t
        with self._lock:
            self._serial += 1
            key = f"act.{self._serial}"
            self.live.add(key)
            self.bytes_put += t.nbytes
        self.store.put(key, t.detach(), Tier.HOST)
        return _Paged(key, t.device, t.nbytes)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Paged):
            return packed
        if self.store.tier_of(packed.key) == Tier.NVME:
            with self._lock:
                self.bytes_from_nvme += packed.nbytes
        stored = self.store.fetch_now(packed.key, self.work_tier)
        try:
            t = stored.to(packed.device, copy=True)
        finally:
            self.store.release(packed.key)
        self._drop(packed.key)
        return t

    def _drop(self, key: str) -> None:
        with self._lock:
            if key not in self.live:
                return
            self.live.discard(key)
        self.store.delete(key)

    def clear(self) -> None:
        """Delete what a failed or abandoned batch left behind."""
        for key in list(self.live):
            if key in self.store:
                self._drop(key)
        self.live.clear()


class _Paged:
    __slots__ = ("key", "device", "nbytes")

    def __init__(self, key: str, device: torch.device, nbytes: int) -> None:
        self.key, self.device, self.nbytes = key, device, nbytes
