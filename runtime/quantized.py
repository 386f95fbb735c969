"""Frozen weights stored quantized in the tiers (`Config.quantize`): bitsandbytes' codes and scales.

[Note: quantized frozen units] A frozen unit whose parameters include the weight of an
`nn.Linear` (one the model family does not keep whole, as transformers keeps the output head)
rests in the store as bytes, `QuantizedLayout`: for each such weight the codes and scales
bitsandbytes makes of it, and for the unit's other parameters (biases, norms) their values in the
compute dtype. 4-bit (NF4 or FP4, `quantize_4bit`): two codes a byte, blocks of 64, an fp32 absmax
per block, or with double quantization a byte per block beside an fp32 absmax per 256 blocks and
their offset. 8-bit (`int8_vectorwise_quant`, as `Linear8bitLt` stores a weight): a signed byte an
element and an fp32 absmax per row, taken from the weight's fp16 values as bitsandbytes takes them.
Gathering the unit decodes each weight into the unit's flat buffer, so the layers compute with the
values bitsandbytes' `Linear4bit` computes with, and those `Linear8bitLt` computes with in training
on the CPU (on a GPU bitsandbytes rounds the activations to 8 bits too; outcore does not, see
docs/design.md). Such a unit is never resident and never borrows its shard (the stored bytes are
not the flat buffer's): it is decoded at every gather, and a weight's bytes in the tiers and on
the wire are 0.56 of a byte a parameter in 4 bits (0.52 with double quantization), 1 in 8, where
bf16 takes 2.

The weights are quantized once, as they stream in at the start. Quantizing is deterministic: the
same weights and settings give the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from outcore.runtime.frozen_in_place import UnitSpans
    from outcore.runtime.units import ParamSlot, UnitPlan

BLOCK = 64  # elements a 4-bit scale covers (bitsandbytes' blocksize, as transformers loads QLoRA bases)
NESTED_BLOCK = 256  # scales a nested scale covers under double quantization
_ALIGN = 4  # each part starts on a 4-byte boundary, so that its fp32 view needs no copy


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _bnb():  # imported where used: bitsandbytes is the `qlora` extra
    try:
        import bitsandbytes.functional as functional
    except ImportError as e:
        raise ImportError("Config.quantize needs bitsandbytes (>= 0.46 runs on the CPU): pip install "
                          "'outcore[qlora]'.") from e
    return functional


def code_table(kind: str) -> torch.Tensor:
    """bitsandbytes' fixed code table (fp32, on the CPU): "nf4" or "fp4" (16 values), or "dynamic",
    the 256 values of the nested scales under double quantization."""
    if kind == "dynamic":
        return _bnb().create_dynamic_map(signed=True).float()
    return _bnb().get_4bit_type(kind, device="cpu").float()


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight's stored bytes, each part 4-byte aligned, in the order and sizes of the tensors
    bitsandbytes saves for it. 4-bit: [codes | code table | scales] (`weight`, `.quant_map`,
    `.absmax`, and under double quantization `.nested_absmax` and `.nested_quant_map`); the offset
    of the nested scales, a number in bitsandbytes' saved state, is kept beside (`QuantizedLayout`).
    8-bit: [codes | row scales] (the layer's `weight` and `SCB`)."""

    shape: tuple[int, ...]
    kind: str  # "nf4", "fp4" or "int8"
    double: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def blocks(self) -> int:
        return -(-self.numel // BLOCK)

    def parts(self) -> list[tuple[str, int, int]]:
        """(name, byte offset within the weight's bytes, bytes) of each part, in the order stored."""
        if self.kind == "int8":
            sizes = [("codes", self.numel), ("row_absmax", self.shape[0] * 4)]
        elif self.double:
            nested = -(-self.blocks // NESTED_BLOCK)
            sizes = [("codes", -(-self.numel // 2)), ("code", 16 * 4), ("absmax", self.blocks),
                     ("nested_absmax", nested * 4), ("nested_code", 256 * 4)]
        else:
            sizes = [("codes", -(-self.numel // 2)), ("code", 16 * 4), ("absmax", self.blocks * 4)]
        out, at = [], 0
        for name, n in sizes:
            out.append((name, at, n))
            at += _aligned(n)
        return out

    @property
    def nbytes(self) -> int:
        return sum(_aligned(n) for _, _, n in self.parts())

    def _split(self, raw: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: raw[at : at + n] for name, at, n in self.parts()}

    def encode(self, weight: torch.Tensor, out: torch.Tensor) -> float | None:
        """`weight` (this shape) quantized into `out` (uint8, `nbytes`), as bitsandbytes quantizes it;
        returns the nested scales' offset (None without double quantization)."""
        parts = self._split(out)
        if self.kind == "int8":  # from fp16 values, as `Int8Params` quantizes a weight
            codes8, row_absmax, _ = _bnb().int8_vectorwise_quant(weight.detach().to(torch.float16).contiguous())
            parts["codes"].copy_(codes8.reshape(-1).view(torch.uint8))
            parts["row_absmax"].view(torch.float32).copy_(row_absmax)
            return None
        codes, state = _bnb().quantize_4bit(weight.detach().float().contiguous(), blocksize=BLOCK,
                                            quant_type=self.kind, compress_statistics=self.double,
                                            quant_storage=torch.uint8)
        parts["codes"].copy_(codes.reshape(-1).view(torch.uint8))
        parts["code"].view(torch.float32).copy_(state.code.float())
        if not self.double:
            parts["absmax"].view(torch.float32).copy_(state.absmax.float())
            return None
        parts["absmax"].copy_(state.absmax.view(torch.uint8))
        parts["nested_absmax"].view(torch.float32).copy_(state.state2.absmax.float())
        parts["nested_code"].view(torch.float32).copy_(state.state2.code.float())
        return float(state.offset)

    def scales(self, raw: torch.Tensor) -> dict[str, torch.Tensor]:
        """The fp32 scales among the stored bytes `raw`, by the name bitsandbytes saves them under:
        one that is not finite makes the weight's values NaN or inf."""
        parts = self._split(raw)
        name = {"int8": "row_absmax"}.get(self.kind, "nested_absmax" if self.double else "absmax")
        saved = {"row_absmax": "SCB", "nested_absmax": "nested_absmax", "absmax": "absmax"}[name]
        return {saved: parts[name].view(torch.float32)}

    def decode(self, raw: torch.Tensor, dtype: torch.dtype, offset: float | None) -> torch.Tensor:
        """The weight's values (this shape, `dtype`) from its stored bytes, on `raw`'s device."""
        parts = self._split(raw)
        if self.kind == "int8":  # the operations of bitsandbytes' `MatMul8bitFp`, so the same values
            codes8 = parts["codes"].view(torch.int8).reshape(self.shape)
            return codes8.to(dtype).mul_(parts["row_absmax"].view(torch.float32).unsqueeze(1).mul(1.0 / 127.0))
        functional = _bnb()
        nested = None
        if self.double:
            nested = functional.QuantState(absmax=parts["nested_absmax"].view(torch.float32),
                                           code=parts["nested_code"].view(torch.float32), blocksize=NESTED_BLOCK,
                                           dtype=torch.float32)
            absmax = parts["absmax"]
        else:
            absmax = parts["absmax"].view(torch.float32)
        state = functional.QuantState(
            absmax=absmax, shape=torch.Size(self.shape), code=parts["code"].view(torch.float32), blocksize=BLOCK,
            quant_type=self.kind, dtype=dtype, state2=nested,
            offset=None if offset is None else torch.tensor(offset, dtype=torch.float32, device=raw.device))
        return functional.dequantize_4bit(parts["codes"].reshape(-1, 1), state)


@dataclass(frozen=True)
class QuantizedLayout:
    """A frozen unit's stored bytes: each parameter's part (a `QuantizedWeight`, or None for one
    kept whole, stored in `plain_dtypes`) at its byte offset; padded and split into equal shards, as
    a flat buffer is. `scale_offsets`: each quantized weight's nested-scales offset, set as it is
    quantized or read from bitsandbytes' saved state."""

    parts: tuple[QuantizedWeight | None, ...]
    plain_dtypes: tuple[torch.dtype, ...]
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    padded: int
    shard: int
    scale_offsets: list[float | None]
    # Where a pre-quantized directory holds these bytes, once read as stored (one entry): a checkpoint
    # records it, so that `outcore export` decodes them without an engine.
    stored_in: list[UnitSpans] = field(default_factory=list)
    # The weights whose scales were found finite at their first decode: frozen bytes that stay so,
    # checked once rather than (with a device sync on a GPU) at every gather.
    scales_checked: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, shapes: list[tuple[int, ...]], quantized: list[bool], kind: str, double: bool,
           plain_dtypes: list[torch.dtype], world: int) -> QuantizedLayout:
        parts, numels, offsets, at = [], [], [], 0
        for shape, q, dtype in zip(shapes, quantized, plain_dtypes, strict=True):
            part = QuantizedWeight(tuple(shape), kind, double) if q else None
            numel = math.prod(shape)
            offsets.append(at)
            parts.append(part)
            numels.append(numel)
            at += _aligned(part.nbytes if part is not None else numel * dtype.itemsize)
        grain = world * _ALIGN * 128  # equal shards of whole 512-byte pieces
        padded = -(-max(at, 1) // grain) * grain
        return cls(tuple(parts), tuple(plain_dtypes), tuple(numels), tuple(offsets), padded, padded // world,
                   [None] * len(parts))

    def encode(self, values: Iterable[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
        """The unit's stored bytes (on the CPU) from its parameters' values (in slot order), each
        weight quantized on `device` (the compute device: bitsandbytes' kernels there are fast)."""
        out = torch.zeros(self.padded, dtype=torch.uint8)
        for i, (part, value, at, numel, dtype) in enumerate(zip(self.parts, values, self.offsets, self.numels,
                                                                 self.plain_dtypes, strict=True)):
            if part is not None:
                self.scale_offsets[i] = part.encode(value if device is None else value.to(device),
                                                    out[at : at + part.nbytes])
            else:
                out[at : at + numel * dtype.itemsize].view(dtype).copy_(value.reshape(-1).to(dtype))
        return out

    def decode_into(self, raw: torch.Tensor, flat: torch.Tensor, flat_offsets: tuple[int, ...],
                    slots: Sequence[ParamSlot]) -> None:
        """Every parameter from the unit's stored bytes `raw` into its place in `flat`; ValueError naming
        the parameter (`slots`, in layout order) whose stored scales are not finite: its values would not be."""
        for index, (part, at, numel, to, dtype, offset) in enumerate(zip(self.parts, self.offsets, self.numels,
                                                                         flat_offsets, self.plain_dtypes,
                                                                         self.scale_offsets, strict=True)):
            target = flat[to : to + numel]
            if part is not None:
                stored = raw[at : at + part.nbytes]
                if index not in self.scales_checked:
                    self._check_scales(part, stored, slots[index])
                    self.scales_checked.add(index)
                target.copy_(part.decode(stored, flat.dtype, offset).reshape(-1))
            else:
                target.copy_(raw[at : at + numel * dtype.itemsize].view(dtype))

    @staticmethod
    def _check_scales(part: QuantizedWeight, stored: torch.Tensor, slot: ParamSlot) -> None:
        for name, scales in part.scales(stored).items():
            if not bool(torch.isfinite(scales).all()):
                raise ValueError(f"the frozen base's {(slot.state_dict_names or ['?'])[0]}: its stored {name} holds "
                                 "NaN or inf, so its values would; the base's files (or the weights quantized from "
                                 "them) are damaged: mend or replace them. Training is not at fault.")


def bytes_per_weight(kind: str, double: bool) -> float:
    """Stored bytes a quantized weight's element takes, its scales included (`QuantizedWeight.nbytes`
    per element, for a large weight: 8-bit's scale a row is left out)."""
    if kind == "int8":
        return 1.0
    return 0.5 + (1 / BLOCK + 4 / (BLOCK * NESTED_BLOCK) if double else 4 / BLOCK)


def linear_weights(kept: set[nn.Module]) -> Callable[[ParamSlot], bool]:
    """Which parameters `Config.quantize` quantizes: the weight of an `nn.Linear` not in `kept`, and
    not tied to another parameter."""
    def wanted(slot: ParamSlot) -> bool:
        return (len(slot.places) == 1 and slot.places[0][1] == "weight" and isinstance(slot.places[0][0], nn.Linear)
                and slot.places[0][0] not in kept)
    return wanted


def quantized_layouts(plans: list[UnitPlan], kind: str, double: bool, wanted: Callable[[ParamSlot], bool],
                      plain_dtype: Callable[[ParamSlot], torch.dtype], world: int) -> list[QuantizedLayout | None]:
    """For each unit plan, the layout of its stored bytes where it is frozen and holds a parameter
    `wanted` quantized, else None; `plain_dtype`: what each other parameter of such a unit is
    stored in. ValueError where no unit would be quantized."""
    out: list[QuantizedLayout | None] = []
    for plan in plans:
        flags = [plan.frozen and wanted(slot) for slot in plan.slots]
        out.append(QuantizedLayout.of([tuple(s.shape) for s in plan.slots], flags, kind, double,
                                      [plain_dtype(s) for s in plan.slots], world) if any(flags) else None)
    if not any(out):
        raise ValueError(f"quantize={kind!r} stores frozen Linear weights quantized, and this model has none frozen "
                         "(a full fine-tune trains them all): add LoRA adapters, or leave quantize unset.")
    return out
