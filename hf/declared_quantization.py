"""config.json's `quantization_config` held against the tensors a pre-quantized directory stores: a
config that says one quantization over files that hold another is refused, naming both, before the
files are read as the config says (transformers would decode them so, wrongly)."""

from __future__ import annotations

from typing import Any

from outcore.runtime.formats.safetensors_header import read_header
from outcore.runtime.pretrained import weight_files
from outcore.runtime.stored_quantized import STATE_MARK


def declared(quantization_config: Any) -> tuple[str, bool] | None:
    """(kind, double quantization) a `BitsAndBytesConfig` (or its dict) asks for, or None."""
    if quantization_config is None:
        return None
    d = quantization_config.to_dict() if hasattr(quantization_config, "to_dict") else dict(quantization_config)
    if d.get("load_in_8bit"):
        return "int8", False
    if d.get("load_in_4bit"):
        return str(d.get("bnb_4bit_quant_type", "fp4")), bool(d.get("bnb_4bit_use_double_quant"))
    return None


def stored(directory: str) -> set[tuple[str, bool]]:
    """The ways the safetensors files of `directory` hold weights quantized, from their headers alone."""
    found: set[tuple[str, bool]] = set()
    try:
        files = weight_files(directory)
    except ValueError:  # a config alone (what `outcore estimate` may size): nothing stored to hold it against
        return found
    for file in files:
        if not file.endswith(".safetensors"):
            continue
        keys = set(read_header(file))
        for key in keys:
            if STATE_MARK in key:
                name = key.split(STATE_MARK)[0]
                found.add((key.split(STATE_MARK)[1], name + ".nested_absmax" in keys))
            elif key.endswith(".SCB"):
                found.add(("int8", False))
    return found


def check_declared(directory: str, config: Any) -> None:
    """ValueError where config.json's quantization_config names another quantization than the files hold."""
    said = declared(getattr(config, "quantization_config", None))
    if said is None:
        return
    held = stored(directory)
    if held and held != {said}:
        kinds = ", ".join(f"{kind}{' with double quantization' if double else ''}" for kind, double in sorted(held))
        raise ValueError(f"--model {directory!r}: config.json's quantization_config says {said[0]}"
                         f"{' with double quantization' if said[1] else ''}, and its weights files hold {kinds}: mend "
                         "quantization_config to what the files hold, or save the model again.")
