"""`BitsAndBytesConfig` as outcore's `Config.quantize` (runtime/quantized.py stores the base so).

    config = outcore.hf.quantized_config(outcore.Config(...), BitsAndBytesConfig(load_in_4bit=True, ...))

The Trainer takes the same from `quantization_config=` or `args.model_init_kwargs["quantization_config"]`.
A setting outcore does not honour is refused in one line, never dropped: 8-bit loading, a storage
dtype other than uint8, modules kept whole by name, and a 4-bit compute dtype other than the run's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from outcore.runtime.config import Config

_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def quantized_config(config: Config, quantization_config: Any) -> Config:
    """`config` with the quantization a `BitsAndBytesConfig` (or its dict) asks for; ValueError
    naming the setting where outcore cannot honour it."""
    if quantization_config is None:
        return config
    d = quantization_config.to_dict() if hasattr(quantization_config, "to_dict") else dict(quantization_config)
    if d.get("load_in_8bit"):
        raise ValueError("quantization_config load_in_8bit=True: outcore stores a frozen base 4-bit "
                         "(load_in_4bit=True, bnb_4bit_quant_type 'nf4' or 'fp4'); 8-bit is not supported yet.")
    if not d.get("load_in_4bit"):
        raise ValueError("quantization_config asks for no 4-bit loading (load_in_4bit is not True); set it, or leave "
                         "quantization_config out.")
    kind = d.get("bnb_4bit_quant_type", "fp4")
    storage = str(d.get("bnb_4bit_quant_storage", "uint8")).removeprefix("torch.")
    if storage != "uint8":
        raise ValueError(f"quantization_config bnb_4bit_quant_storage={storage!r}: outcore stores the codes as uint8; "
                         "leave it at its default.")
    if d.get("llm_int8_skip_modules"):
        raise ValueError(f"quantization_config llm_int8_skip_modules={d['llm_int8_skip_modules']!r}: outcore keeps the "
                         "embeddings and the output head whole and quantizes every other frozen Linear weight; leave "
                         "it unset.")
    compute = _DTYPE_NAMES.get(str(d.get("bnb_4bit_compute_dtype") or "float32").removeprefix("torch."))
    if compute != config.dtype:
        raise ValueError(f"quantization_config bnb_4bit_compute_dtype is {compute}, and the run computes in "
                         f"{config.dtype}: outcore dequantizes the base to the run's compute dtype; make them agree "
                         "(bf16=True with torch.bfloat16, or fp32 with torch.float32).")
    return dataclasses.replace(config, quantize=kind, quantize_double=bool(d.get("bnb_4bit_use_double_quant")))
