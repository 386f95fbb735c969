"""Which model a command means: a GPT preset or `module:factory` (a function returning an nn.Module).

Models are built under `runtime.deferred_init()`, so naming a 7B model costs no memory until an
engine materializes it unit by unit.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from outcore.hf.source import HFModel, is_hf_directory
from outcore.runtime import deferred_init
from outcore.runtime.units import plan_layout, plan_units
from outcore.tools.gpt import GPT, PRESETS, GPTConfig, init_fn


@dataclass
class ModelSource:
    name: str
    build: Callable[[], nn.Module]  # call under deferred_init()
    gpt: GPTConfig | None  # set for presets
    init_fn: Callable[[nn.Module], None] | None
    weights: str | None = None  # a Hugging Face directory: the Engine's `weights=`


def resolve_model(spec: str, *, seq: int | None = None, causal_only: bool = True) -> ModelSource:
    """'gpt-125m' (a preset), a Hugging Face model directory, or 'package.module:factory'; ValueError
    naming the choices otherwise. `causal_only`: a directory must hold a causal LM (`HFModel`)."""
    if is_hf_directory(spec):
        hf = HFModel(spec, causal_only=causal_only)
        return ModelSource(spec, hf.build, None, None, weights=spec)
    if spec in PRESETS:
        cfg = PRESETS[spec] if seq is None else dataclasses.replace(PRESETS[spec], seq=seq)
        return ModelSource(spec, lambda: GPT(cfg), cfg, init_fn(cfg))
    if ":" not in spec:
        raise ValueError(f"model {spec!r}: name a preset ({', '.join(PRESETS)}), a model directory or module:factory.")
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"model {spec!r}: cannot import {attr!r} from {module_name!r} ({e}).") from e
    if not callable(factory):
        raise ValueError(f"model {spec!r}: {attr!r} is not callable; give a function that returns an nn.Module.")
    return ModelSource(spec, factory, None, None)


def unit_numels(source: ModelSource, unit_classes: tuple[str, ...] = ()) -> list[int]:
    """Parameters per fetch unit (root unit last), from a meta-device build: no memory used."""
    return source_layout(source, unit_classes)[0]


def source_layout(source: ModelSource, unit_classes: tuple[str, ...] = ()) -> tuple[list[int], dict]:
    """`unit_layout` of the source's model, built on the meta device: no memory used."""
    with deferred_init():
        model = source.build()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {source.name!r}: the factory returned {type(model).__name__}, not an nn.Module.")
    return unit_layout(model, unit_classes)


def unit_layout(model: nn.Module, unit_classes: tuple[str, ...] = ()) -> tuple[list[int], dict]:
    """Parameters per fetch unit of a (meta-device) model, and what `estimate` needs beside them
    (`plan_layout`: frozen units, the root's, shared modules, large modules outside the blocks)."""
    return plan_layout(plan_units(model, unit_classes))


def gpt_of_size(params: int, vocab: int = 32000, seq: int = 2048) -> GPTConfig:
    """A GPT shape with about `params` parameters (depth grows with size, as in the presets)."""
    layers = 12 if params < 2e8 else 24 if params < 1.5e9 else 32 if params < 1e10 else 48 if params < 4e10 else 80
    # params ≈ 12·L·d² + (vocab + seq)·d: solve for d, round to a multiple of 8.
    a, b = 12 * layers, vocab + seq
    d = (-b + (b * b + 4 * a * params) ** 0.5) / (2 * a)
    d = max(64, int(round(d / 8)) * 8)
    return GPTConfig(vocab=vocab, seq=seq, layers=layers, d_model=d, heads=8)


def synthetic_unit_numels(params: int) -> tuple[list[int], GPTConfig]:
    """Unit sizes of a GPT with about `params` parameters, without building it."""
    cfg = gpt_of_size(params)
    d = cfg.d_model
    block = 12 * d * d + 13 * d
    root = cfg.vocab * d + cfg.seq * d + 2 * d
    return [block] * cfg.layers + [root], cfg
