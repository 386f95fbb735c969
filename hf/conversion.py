"""Stored tensor names as transformers converts them on load, for `Engine(weights=...)`.

[Note: converted checkpoints] transformers 5 renames and merges some checkpoint tensors as it loads
them, and its `save_pretrained` writes the stored form back: GPT-NeoX stores its head as
`embed_out`, the model calls it `lm_head`; a mixture of experts stores each expert's matrices
apart (`experts.3.w1.weight`), the model holds one stacked tensor per layer
(`experts.gate_up_proj`). `weights=` reads such files as `from_pretrained` does. A stored name the
model does not have goes through the model's own conversion list (transformers'
`get_model_conversion_mapping`): a renamed tensor is read as it is, and a merged one is built from
its parts by transformers' own operations when its unit is materialized: one merged tensor at a
time, its parts and then the merged whole (one layer's experts, twice at most). Without that API
(transformers 4), names are matched as they are.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from outcore.hf.model_info import wrapped_model
from outcore.runtime.model_family import StoredPart

log = logging.getLogger(__name__)


Stored = TypeVar("Stored", bound=StoredPart)


@dataclass(frozen=True, slots=True)
class MergedTensor:
    """A model tensor that transformers builds from several stored ones."""

    file: str  # its first part's, for messages
    key: str  # the model's name for it
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    parts: tuple[tuple[str, StoredPart], ...]  # (the converter's source pattern, the stored part), in stacking order
    converter: Any  # the transformers WeightConverter that builds it
    group: str  # the name transformers files the conversion under (its first output's)


def _transformers_api() -> Any | None:
    try:
        from transformers import core_model_loading
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return None
    return get_model_conversion_mapping, core_model_loading


def convert_names(model: nn.Module, stored: dict[str, Stored | MergedTensor],
                  wanted: set[str]) -> tuple[dict[str, Stored | MergedTensor], int]:
    """`stored` (by name) under the model's names where transformers would convert them; names the
    model has, and names no conversion maps to one it has, stay as they are (the caller reports
    those). Returns the tensors and how many stored names were converted."""
    api = _transformers_api()
    hf_model = wrapped_model(model)
    if api is None or not hasattr(hf_model, "config") or all(name in wanted for name in stored):
        return dict(stored), 0
    try:
        return _convert(api, hf_model, stored, wanted)
    except (AttributeError, TypeError) as e:  # transformers' loading internals moved in this version
        log.warning("weights: transformers' name conversions could not be applied (%s); stored names are "
                    "matched as they are", e)
        return dict(stored), 0


def _convert(api: Any, hf_model: Any, stored: dict[str, Stored | MergedTensor],
             wanted: set[str]) -> tuple[dict[str, Stored | MergedTensor], int]:
    get_mapping, loading = api
    mapping = get_mapping(hf_model)
    renamings = [t for t in mapping if isinstance(t, loading.WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, loading.WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    present = dict.fromkeys(wanted, True)  # what transformers' prefix rule looks names up in
    out: dict[str, Stored | MergedTensor] = {}
    groups: dict[str, tuple[Any, list[tuple[str, Stored]]]] = {}
    converted = 0
    for name in sorted(stored, key=loading.dot_natural_key):  # experts.10 after experts.9, as transformers stacks
        target, pattern = (name, None) if name in wanted else loading.rename_source_key(
            name, renamings, converters, getattr(hf_model, "base_model_prefix", None), present)
        part = stored[name]
        if target not in wanted or isinstance(part, MergedTensor):
            out[name] = part
            continue
        converted += target != name
        if pattern is None:
            if target in out:
                raise ValueError(f"tensors {name!r} and {out[target].key!r} are both the model's {target!r}.")
            out[target] = part
        else:
            groups.setdefault(target, (by_pattern[pattern], []))[1].append((pattern, part))
    for target, (converter, parts) in groups.items():
        for key, shape in _outputs(converter, target, parts, hf_model).items():
            out[key] = MergedTensor(parts[0][1].file, key, shape, parts[0][1].dtype, tuple(parts), converter,
                                    target)
    return out, converted


def _outputs(converter: Any, target: str, parts: Sequence[tuple[str, StoredPart]],
             model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The names and shapes a converter makes of `parts` (run on meta tensors: nothing is read)."""
    def meta(part: StoredPart) -> torch.Tensor:
        return torch.empty(part.shape, dtype=part.dtype or torch.float32, device="meta")

    try:
        built = _run(converter, target, parts, meta, model)
    except Exception as e:  # noqa: BLE001 - transformers' operations raise what they raise
        why = " ".join(str(e).split())
        raise ValueError(f"tensors {parts[0][1].key!r} and the rest that make the model's {target!r} "
                         f"({len(parts)} in all, in {parts[0][1].file!r}) cannot be merged as transformers does "
                         f"({why}): these weights are for another model or config, or a part is missing.") from e
    return {key: tuple(value.shape) for key, value in built.items()}


def _run(converter: Any, target: str, parts: Sequence[tuple[str, StoredPart]],
         read: Callable[[StoredPart], torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    fresh = copy.deepcopy(converter)  # a converter collects its inputs: one instance per merged tensor
    for pattern, part in parts:
        fresh.add_tensor(target, part.key, pattern, functools.partial(read, part))
    return fresh.convert(target, model=model, config=getattr(model, "config", None))


def assemble(merged: MergedTensor, read: Callable[[StoredPart], torch.Tensor], model: nn.Module) -> torch.Tensor:
    """The merged tensor, its parts read one by one with `read`."""
    return _run(merged.converter, merged.group, merged.parts, read, wrapped_model(model))[merged.key]
