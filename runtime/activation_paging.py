"""Where an engine's saved activations go (`Config.offload_activations`), and what a step paged.

One `SavedActivations` (runtime/saved_activations.py) per forward under grad (`engine(...)`) or per
`train_batch`; this owns the choice of tier and the counts a step reports:

- "none": kept where autograd puts them;
- "cpu":  put in the store's HOST tier (off the GPU; they page on to NVMe only where the HOST budget
          must make room, as any key does);
- "nvme": written to the swap file as they are saved, read back in backward;
- "auto": an `engine(...)` pass keeps what it saves in place while that fits in half of what its
          compute device has free as the pass starts (the units' windows and the recompute want
          the rest), and pages the rest to HOST; a `train_batch` (K micro-batches' activations at
          once) pages them all where the engine pages its states (parameters or optimizer states
          offloaded, or a HOST budget given), and keeps them in place otherwise.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Protocol

import psutil
import torch

from outcore.offload import Tier, TieredStore
from outcore.runtime.saved_activations import SavedActivations

log = logging.getLogger("outcore.runtime.activations")

COUNTS = ("bytes_paged", "bytes_from_nvme", "bytes_kept")  # what `engine.stats()["activations"]` says of a step
ACTIVATION_HOST = 1 << 30  # the most a derived host budget adds for paged activations


class Placement(Protocol):
    """What of `Config` this reads (runtime/config.py imports the policy this module's names come from)."""

    offload_params: str
    offload_optimizer: str
    offload_activations: str
    host_budget: int | None


class ActivationPaging:
    def __init__(self, config: Placement, store: TieredStore, device: torch.device, *,
                 is_parameter: Callable[[torch.Tensor], bool]) -> None:
        self.mode, self.store, self.device, self.is_parameter = config.offload_activations, store, device, is_parameter
        self.pages_states = ({config.offload_params, config.offload_optimizer} != {"none"}
                             or config.host_budget is not None)
        # fixed when the store opened; stats() walks every key, too much for each forward
        self.host_budget = store.stats()["host"]["budget"]
        self._open: list[SavedActivations] = []  # this step's passes whose keys autograd may still want
        self._counted = dict.fromkeys(COUNTS, 0)  # this step's passes done with
        self._said_compiled = False
        self.last_step = dict.fromkeys(COUNTS, 0)

    def for_batch(self) -> SavedActivations:
        """What one train_batch saves (see the module docstring)."""
        paged = self.mode in ("cpu", "nvme") or (self.mode == "auto" and self.pages_states)
        return self._saved(self._tier() if paged else None, in_place=0)

    @contextlib.contextmanager
    def forward(self, model: torch.nn.Module | None = None) -> Iterator[None]:
        """Around one `engine(...)`: what it saves for backward, paged (nothing where none pages).
        A compiled model's saved tensors stay where they are: Dynamo cannot trace the hooks that
        page them (said once where paging was asked for)."""
        compiled = torch.compiler.is_compiling() or getattr(model, "_compiled_call_impl", None) is not None
        if compiled and self.mode in ("cpu", "nvme") and not self._said_compiled:
            self._said_compiled = True
            log.warning("offload_activations=%r: a compiled model's saved activations stay in place (torch.compile "
                        "cannot trace the hooks that page them); run the model uncompiled to page them", self.mode)
        if self.mode == "none" or not torch.is_grad_enabled() or compiled:
            yield
            return
        in_place = free_memory(self.device) // 2 if self.mode == "auto" else 0
        with self._saved(self._tier(), in_place=in_place).hooks():
            yield

    def _tier(self) -> Tier:
        return Tier.NVME if self.mode == "nvme" else Tier.HOST

    def _saved(self, tier: Tier | None, *, in_place: int) -> SavedActivations:
        saved = SavedActivations(self.store, tier, self.is_parameter, host_budget=self.host_budget, in_place=in_place)
        self._fold(done_only=True)  # (forwards without a step between them hold no more than their keys)
        self._open.append(saved)
        return saved

    def _fold(self, *, done_only: bool) -> None:
        """Add the passes' counts to this step's; keep those with live keys where `done_only`."""
        still = []
        for saved in self._open:
            if done_only and saved.holds_keys:
                still.append(saved)
                continue
            for name, value in zip(COUNTS, (saved.bytes_put, saved.bytes_from_nvme, saved.bytes_kept), strict=True):
                self._counted[name] += value
        self._open = still

    def step_done(self) -> None:
        """The optimizer step ended: its passes' counts become the step's figures."""
        self._fold(done_only=False)
        self.last_step, self._counted = self._counted, dict.fromkeys(COUNTS, 0)


def host_share(mode: str, available: int) -> int:
    """HOST bytes a derived host budget adds where activations are asked to page ("cpu", "nvme"):
    room for the keys on their way out and those read back ahead of backward (an eighth of the
    available memory, at most 1 GiB). A budget sized for the states alone (a few KiB where
    nothing is offloaded) would hold no block input, and they would stay in place."""
    return min(available // 8, ACTIVATION_HOST) if mode in ("cpu", "nvme") else 0


def free_memory(device: torch.device) -> int:
    """Bytes the compute device has free now: the GPU's, or the host's available memory on a CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available
