"""The frozen reference a preference trainer compares its policy with, paged by an engine of its own.

`DPOTrainer` and `KTOTrainer` without peft load a second, whole copy of the model from `model=` as
their reference (`ref_model`); `GRPOTrainer` and `RLOOTrainer` with a KL term (`beta > 0`) load it
from the policy's directory (`create_model_from_path`), which `reference_built_from` intercepts.
Under outcore the reference is the same directory read where it lies: every parameter frozen, so
its units rest on spans of the weights files (runtime/frozen_in_place.py) and nothing of it is
copied into a swap file or held whole in memory. With peft the reference is the
base with the adapters off, as plain TRL takes it, and no second engine is made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from outcore.hf.source import HFModel
from outcore.runtime.config import Config
from outcore.runtime.engine import Engine

log = logging.getLogger(__name__)


def takes_reference(init: Callable[..., None]) -> bool:
    """Whether the trainer underneath compares its policy with a reference (`ref_model`)."""
    return "ref_model" in inspect.signature(init).parameters


def wants_reference(init: Callable[..., None], kwargs: dict[str, Any], args: Any, adapters: bool) -> bool:
    """Whether the trainer underneath would load a reference model of its own: it takes `ref_model`,
    none was given, the policy has no adapters to switch off, and the reference log-probs are not
    computed ahead from the policy itself (`precompute_ref_log_probs`)."""
    return (takes_reference(init) and kwargs.get("ref_model") is None and not adapters
            and not getattr(args, "precompute_ref_log_probs", False))


def reference_engine(model: HFModel, config: Config, seed: int) -> Engine:
    """An engine over `model`'s directory with every parameter frozen, read in place; its swap
    directory (where parameters rest on NVMe) a folder of the policy's."""
    module = model.build()
    module.requires_grad_(False)
    nvme_dir = os.path.join(config.nvme_dir, "reference") if config.nvme_dir else None
    reference = dataclasses.replace(config, offload_optimizer="none", nvme_dir=nvme_dir, quantize=None,
                                    quantize_double=False)
    engine = Engine(module, reference, weights=model.directory, seed=seed)
    log.info("the reference model: %s read in place, frozen (nothing of it in a swap file)", model.directory)
    return engine


@contextlib.contextmanager
def reference_built_from(trainer: type, weights: str | None, make: Callable[[], nn.Module]) -> Iterator[None]:
    """While the trainer underneath is built: where it would build a model from `weights` (the
    policy's directory; its reference), it gets `make()` instead, the module of a reference engine.
    Models built from other paths are built as the trainer builds them."""
    modules = [sys.modules[c.__module__] for c in trainer.__mro__
               if hasattr(sys.modules[c.__module__], "create_model_from_path")]
    if weights is None or not modules:
        yield
        return
    saved = [(m, m.create_model_from_path) for m in modules]

    def create_model_from_path(path: str, *args: Any, **kwargs: Any) -> nn.Module:
        if os.path.isdir(path) and os.path.samefile(path, weights):
            return make()
        return saved[0][1](path, *args, **kwargs)

    for m, _ in saved:
        m.create_model_from_path = create_model_from_path  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m, original in saved:
            m.create_model_from_path = original  # type: ignore[attr-defined]


@contextlib.contextmanager
def hashed_by_files(trainer: type, weights: str | None) -> Iterator[None]:
    """While the trainer underneath is built: TRL fingerprints the reference by hashing every tensor
    of the model (`hash_module`, the cache key of precomputed reference log-probs), whose values
    outcore has not read yet. The fingerprint is then taken from the weights files' names, sizes
    and times, and the tensors' names and shapes."""
    modules = [sys.modules[c.__module__] for c in trainer.__mro__ if hasattr(sys.modules[c.__module__], "hash_module")]
    if weights is None or not modules:
        yield
        return

    def hash_module(module: nn.Module) -> str:
        digest = hashlib.sha256()
        for name in sorted(os.listdir(weights)):
            stat = os.stat(os.path.join(weights, name))
            digest.update(f"{name} {stat.st_size} {stat.st_mtime_ns}\n".encode())
        for name, tensor in sorted(module.state_dict().items()):
            digest.update(f"{name} {list(tensor.shape)} {tensor.dtype}\n".encode())
        return digest.hexdigest()

    saved = [(m, m.hash_module) for m in modules]
    for m, _ in saved:
        m.hash_module = hash_module  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m, original in saved:
            m.hash_module = original  # type: ignore[attr-defined]


def check_reference_vocabulary(model: nn.Module, reference: Any) -> None:
    """A `ref_model=` whose vocabulary is not the policy's: its log-probabilities index other tokens
    (or fail mid-step on a shape); refused naming both sizes."""
    if not isinstance(reference, nn.Module):
        return
    ours, theirs = _vocabulary(model), _vocabulary(reference)
    if ours is not None and theirs is not None and ours != theirs:
        raise ValueError(f"ref_model= has a vocabulary of {theirs:,} tokens and the model {ours:,}: the reference "
                         "must score the same tokens. Give a reference built from the same tokenizer, or leave "
                         "ref_model out (outcore reads the model's own starting weights as the reference).")


def _vocabulary(model: nn.Module) -> int | None:
    head = getattr(model, "get_output_embeddings", lambda: None)()
    weight = getattr(head, "weight", None)
    if weight is not None:
        return int(weight.shape[0])
    return getattr(getattr(model, "config", None), "vocab_size", None)
