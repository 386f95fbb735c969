"""`BitsAndBytesConfig` as outcore's `Config.quantize` (runtime/quantized.py stores the base so).

    config = outcore.hf.quantized_config(outcore.Config(...), BitsAndBytesConfig(load_in_4bit=True, ...))

The Trainer takes the same from `quantization_config=` or `args.model_init_kwargs["quantization_config"]`.
A setting outcore does not honour is refused in one line, never dropped: a storage dtype other than
uint8, modules kept whole by name, a 4-bit compute dtype other than the run's, and 8-bit weights kept
in fp16 beside their codes. 8-bit's outlier threshold is said once to be unused: outcore computes
with the dequantized weight, as bitsandbytes does on the CPU in training (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from outcore.runtime.config import Config

log = logging.getLogger(__name__)

_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def quantized_config(config: Config, quantization_config: Any) -> Config:
    """`config` with the quantization a `BitsAndBytesConfig` (or its dict) asks for; ValueError
    naming the setting where outcore cannot honour it."""
    if quantization_config is None:
        return config
    d = quantization_config.to_dict() if hasattr(quantization_config, "to_dict") else dict(quantization_config)
    if d.get("load_in_8bit"):
        return _eight_bit(config, d)
    if not d.get("load_in_4bit"):
        raise ValueError("quantization_config asks for neither 4-bit nor 8-bit loading (load_in_4bit and load_in_8bit "
                         "are not True); set one, or leave quantization_config out.")
    kind = d.get("bnb_4bit_quant_type", "fp4")
    storage = str(d.get("bnb_4bit_quant_storage", "uint8")).removeprefix("torch.")
    if storage != "uint8":
        raise ValueError(f"quantization_config bnb_4bit_quant_storage={storage!r}: outcore stores the codes as uint8; "
                         "leave it at its default.")
    _check_kept_whole(d)
    compute = _DTYPE_NAMES.get(str(d.get("bnb_4bit_compute_dtype") or "float32").removeprefix("torch."))
    if compute != config.dtype:
        raise ValueError(f"quantization_config bnb_4bit_compute_dtype is {compute}, and the run computes in "
                         f"{config.dtype}: outcore dequantizes the base to the run's compute dtype; make them agree "
                         "(bf16=True with torch.bfloat16, or fp32 with torch.float32).")
    return dataclasses.replace(config, quantize=kind, quantize_double=bool(d.get("bnb_4bit_use_double_quant")))


def _eight_bit(config: Config, d: dict[str, Any]) -> Config:
    if d.get("llm_int8_has_fp16_weight"):
        raise ValueError("quantization_config llm_int8_has_fp16_weight=True keeps each 8-bit weight in fp16 too, to "
                         "train it: outcore stores a frozen base's codes alone; leave it False and train adapters.")
    _check_kept_whole(d)
    threshold = d.get("llm_int8_threshold", 6.0)
    (log.warning if threshold != 6.0 else log.info)(
        "quantization_config llm_int8_threshold=%s is not used: outcore computes with each 8-bit weight "
        "dequantized, as bitsandbytes does on the CPU in training (no outlier split)", threshold)
    return dataclasses.replace(config, quantize="int8", quantize_double=False)


def _check_kept_whole(d: dict[str, Any]) -> None:
    if d.get("llm_int8_skip_modules"):
        raise ValueError(f"quantization_config llm_int8_skip_modules={d['llm_int8_skip_modules']!r}: outcore keeps the "
                         "embeddings and the output head whole and quantizes every other frozen Linear weight; leave "
                         "it unset.")
