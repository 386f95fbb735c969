"""The model's states as the engine laid them out: what checkpoints, state dicts and export read."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from outcore.offload import TieredStore
from outcore.runtime.checkpoint.base_files import BaseFiles
from outcore.runtime.checkpoint.guard import WriterLock
from outcore.runtime.collectives import Group
from outcore.runtime.flat_unit import FlatUnit
from outcore.runtime.model_family import ModelFamily
from outcore.runtime.policy import Placement
from outcore.runtime.update_stream import UpdateStream

# The engine's parameters are views it sets as plain attributes, not registered parameters. Models
# that read their device and dtype from their first parameter (Hugging Face's `model.device`,
# `model.dtype`, which `generate()` uses) find this zero-size one instead, on the model itself
# (under peft, on the base model, whose own `generate()` a peft model runs).
ANCHOR = "outcore_anchor"

log = logging.getLogger(__name__)
_TENSOR_GRAD: Any = vars(torch._C.TensorBase)["grad"]  # the C descriptor AnchorParameter's `grad` wraps
_MODULE_APPLY = nn.Module._apply.__code__  # model.to(), .float(), ...: moves every parameter's .grad too
_MODULE_ZERO_GRAD = nn.Module.zero_grad.__code__  # clears what is there: nothing lost by it


class AnchorParameter(nn.Parameter):
    """The zero-size parameter `ANCHOR`. Its `.grad` is where a plain PyTorch habit looks for the
    model's gradients (`clip_grad_norm_(model.parameters())`, `model.zero_grad()`) and finds none:
    clipping would clip nothing without a word. So reading it says once in the log what to use;
    not where `model.to()` reads it to move it, where `model.zero_grad()` clears it (a Trainer's
    loop calls it every step, harmlessly), nor where torch's internals probe it (torch.compile
    asks every tensor it meets whether it has a gradient): none is a sign of that habit."""

    _said = False

    @property
    def grad(self) -> torch.Tensor | None:
        caller = sys._getframe(1)
        if (not AnchorParameter._said and caller.f_code not in (_MODULE_APPLY, _MODULE_ZERO_GRAD)
                and not caller.f_globals.get("__name__", "").startswith("torch._")):
            AnchorParameter._said = True
            log.warning("a .grad of model.parameters() was read, but outcore's engine holds the model's weights "
                        "and gradients itself: model.parameters() yields one empty anchor, so "
                        "clip_grad_norm_(model.parameters()) clips nothing. Clip with Config.grad_clip (the norm "
                        "is in engine.step()'s stats); engine.step() clears the gradients, no zero_grad() needed.")
        return _TENSOR_GRAD.__get__(self)

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        _TENSOR_GRAD.__set__(self, value)


class StateDictGuard:
    """A state-dict post-hook on every module that gave its parameters to the engine: called from
    outside, `state_dict()` would return the buffers alone and look complete (saved, it loses
    every weight; DeepSpeed's ZeRO-3 returns empty tensors there), so it raises instead and names
    what reads the weights. The engine's own reads of the buffers go through `open()`."""

    def __init__(self) -> None:
        self._open = False

    @contextlib.contextmanager
    def open(self) -> Iterator[None]:
        self._open, before = True, self._open
        try:
            yield
        finally:
            self._open = before

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        if not self._open:
            raise RuntimeError(
                "state_dict() was called on a module whose parameters outcore's engine holds: it would return "
                "no weights. Read them through the engine: engine.full_state_dict() (on every rank; the whole "
                "model in CPU memory), engine.export(path) (streamed to a .safetensors file or a Hugging Face "
                "directory, also in place of save_pretrained), or engine.save_checkpoint(directory).")

    def before_load(self, *_hook_arguments: Any) -> None:
        """A load_state_dict pre-hook: the loaded values could not reach the shards in the store."""
        if not self._open:
            raise RuntimeError(
                "load_state_dict() was called on a module whose parameters outcore's engine holds: the values "
                "cannot reach its shards. Give weights when the engine is built (Engine(..., weights=path) "
                "reads a .safetensors file or a Hugging Face directory unit by unit), or restore a run with "
                "engine.load_checkpoint(directory).")


@dataclass(frozen=True, eq=False)
class ShardedModel:
    """The wrapped model, its units and where their shards rest.

    Readers call `settle()` first: it waits for every update in flight, so what they read is the
    state after the last `step()`.
    """

    model: nn.Module
    units: list[FlatUnit]
    store: TieredStore
    place: Placement
    group: Group
    updates: UpdateStream
    state_dict_keys: list[str]  # `model.state_dict()`'s keys, in its order, taken before sharding
    family: ModelFamily  # what the engine asks of the model beyond nn.Module (runtime/model_family.py)
    guard: StateDictGuard = field(default_factory=StateDictGuard)
    writer_lock: WriterLock = field(default_factory=WriterLock)  # the checkpoint directory it saves into
    base: BaseFiles | None = None  # the weights files it started from (`weights=`), which checkpoints record

    @property
    def store_state_dtype(self) -> str:
        """What the optimizer states are stored in: "fp32" or "bf16" (`Config.state_dtype`)."""
        return "fp32" if self.updates.rounding is None else "bf16"

    def settle(self) -> None:
        self.updates.drain()

    @functools.cached_property
    def _anchor_owner(self) -> nn.Module:
        """The model itself: the root, or under peft the base model, whose `generate()` reads its own
        device from its parameters."""
        return self.family.inner()

    def anchor(self, device: torch.device, dtype: torch.dtype) -> None:
        """Register the zero-size parameter of `ANCHOR` on `_anchor_owner`."""
        self._anchor_owner.register_parameter(
            ANCHOR, AnchorParameter(torch.empty(0, device=device, dtype=dtype), requires_grad=False))

    def check_unconverted(self, device: torch.device, dtype: torch.dtype) -> None:
        """Refuse to run a model that `.half()`, `.to(dtype)` or `.to(device)` reached after the
        engine took its weights: that converted its buffers (and the anchor) but none of the weights,
        which stay as the engine computes them."""
        anchor = self._anchor_owner.get_parameter(ANCHOR)  # looked up each time: a conversion may replace it
        moved = anchor.device.type != device.type or (device.index is not None and anchor.device.index != device.index)
        if anchor.dtype != dtype or moved:
            raise RuntimeError(
                f"the model was converted after outcore's engine wrapped it (now {anchor.dtype} on {anchor.device}; "
                f"the engine computes in {dtype} on {device}): .half(), .to(dtype) and .to(device) reach its "
                "buffers but not the weights the engine holds. Choose the compute dtype with Config(dtype=...) and "
                "the device with Engine(device=...), and build the engine again from the model before conversion.")

    def guard_state_dict(self) -> None:
        """Put `guard` on every module that owns a parameter the engine took."""
        owners = {id(m): m for u in self.units for slot in u.plan.slots for m, _ in slot.places}
        for module in owners.values():
            module.register_state_dict_post_hook(self.guard)
            module.register_load_state_dict_pre_hook(self.guard.before_load)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The model's buffers by state-dict name (all its state dict holds once sharded), on CPU."""
        with self.guard.open():
            return {k: v.detach().cpu() for k, v in self.model.state_dict().items()
                    if k.rpartition(".")[2] != ANCHOR}
