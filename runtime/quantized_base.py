"""What an engine's start does with a quantized base (`Config.quantize`, runtime/quantized.py): the
setting a directory saved quantized asks for, which parameters rest quantized and in what the others
of their units are stored, and the spans of the files such a unit is read from in place
(runtime/stored_quantized.py)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from outcore.offload.file_source import FileSpan
from outcore.runtime.config import Config
from outcore.runtime.frozen_in_place import UnitSpans
from outcore.runtime.pretrained import PretrainedWeights
from outcore.runtime.quantized import QuantizedLayout, linear_weights, quantized_layouts

if TYPE_CHECKING:
    from outcore.runtime.flat_unit import FlatUnit
    from outcore.runtime.units import ParamSlot, UnitPlan

log = logging.getLogger(__name__)


def as_stored(config: Config, pretrained: PretrainedWeights | None) -> Config:
    """`config` with the quantization the weights are stored in: taken where `Config.quantize` is
    unset (said once), refused where it names another."""
    if pretrained is None or not pretrained.quantized:
        return config
    settings = {(q.weight.kind, q.weight.double) for q in pretrained.quantized.values()}
    if len(settings) > 1:
        raise ValueError(f"weights {pretrained.path!r} hold weights quantized in several ways "
                         f"({sorted(settings)}); outcore reads one.")
    (kind, double), = settings
    if config.quantize is None:
        log.info("weights %s are stored quantized (%s%s): read as stored", pretrained.path, kind,
                 ", double quantization" if double else "")
        return dataclasses.replace(config, quantize=kind, quantize_double=double)
    if (config.quantize, config.quantize_double) != (kind, double):
        raise ValueError(f"weights {pretrained.path!r} are stored quantized as {kind} (quantize_double={double}), "
                         f"and the config asks for {config.quantize} (quantize_double={config.quantize_double}): give "
                         "the stored setting, or leave quantize unset to take it.")
    return config


def quantized_slots(pretrained: PretrainedWeights | None, kept: set[nn.Module], compute: torch.dtype
                    ) -> tuple[Callable[[ParamSlot], bool], Callable[[ParamSlot], torch.dtype]]:
    """Which parameters rest quantized and what a quantized unit's other parameters are stored in:
    the files' quantized weights and their stored dtypes (read as stored, in place) where the weights
    hold any; else every Linear weight not `kept`, the rest in the `compute` dtype."""
    if pretrained is None or not pretrained.quantized:
        return linear_weights(kept), lambda _slot: compute

    def stored_dtype(slot: ParamSlot) -> torch.dtype:
        stored = pretrained.as_stored(slot)
        return stored.dtype if stored is not None and stored.dtype is not None else compute

    return (lambda slot: pretrained.quantized_of(slot) is not None), stored_dtype


def stored_spans(unit: FlatUnit, pretrained: PretrainedWeights) -> UnitSpans | None:
    """The spans of the files a quantized unit's stored bytes are, where the files hold every one of
    its quantized weights quantized and its other parameters in the dtype its layout stores them in
    (each weight's nested-scales offset is taken from its saved state); else None."""
    q = unit.quantized
    assert q is not None
    spans: list[FileSpan] = []
    for i, (slot, part, at) in enumerate(zip(unit.plan.slots, q.parts, q.offsets, strict=True)):
        if part is None:
            stored = pretrained.as_stored(slot)
            if stored is None or stored.dtype != q.plain_dtypes[i]:
                return None
            spans.append(FileSpan(stored.file, stored.begin, torch.uint8, stored.nbytes, at))
            continue
        saved = pretrained.quantized_of(slot)
        if saved is None:
            return None
        q.scale_offsets[i] = saved.offset
        for name, within, nbytes in part.parts():
            tensor = saved.parts[name]
            spans.append(FileSpan(tensor.file, tensor.begin, torch.uint8, nbytes, at + within))
    found = UnitSpans(tuple(spans), {s.path: pretrained.stamps[s.path] for s in spans})
    q.stored_in[:] = [found]
    return found


def quantized_plans(plans: list[UnitPlan], config: Config, pretrained: PretrainedWeights | None, kept: set[nn.Module],
                    compute: torch.dtype, world: int) -> list[QuantizedLayout | None]:
    """Each unit's stored layout where `config` quantizes it (`quantized_slots` says which), else None."""
    if config.quantize is None:
        return [None] * len(plans)
    return quantized_layouts(plans, config.quantize, config.quantize_double,
                             *quantized_slots(pretrained, kept, compute), world)
