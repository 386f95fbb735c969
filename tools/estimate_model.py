"""The model `outcore estimate` sizes, from its flags: a GPT of `--params` parameters, a preset, a
Hugging Face model directory (with `--lora` adapters, its base optionally `--quantize`d) or
module:factory; its units, their layout, its shape (for activations) and a line saying what it is."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from outcore.hf.generation import kv_width
from outcore.hf.source import HFModel
from outcore.runtime.sizes import human_count
from outcore.tools.estimate import hf_dims, quantized_stored
from outcore.tools.model_source import resolve_model, source_layout, synthetic_unit_numels, unit_layout


@dataclass
class SizedModel:
    units: list[int]
    layout: dict = field(default_factory=dict)
    dims: tuple[int, int, int, int] | None = None  # layers, d_model, vocab, context
    what: str = ""
    hf: bool = False  # a Hugging Face model directory (activation checkpointing on under `train`)
    kv_width: int | None = None  # its attention's key/value width (tools/generation_memory.py)


def sized_model(args: argparse.Namespace) -> SizedModel:
    """ValueError naming the flag at fault."""
    if args.lora_targets is not None and args.lora is None:
        raise ValueError("--lora-targets names the modules LoRA adapts: give --lora R too.")
    if (args.quantize is not None or args.quantize_double) and args.lora is None:
        raise ValueError("--quantize sizes a frozen base stored quantized: give --model DIR and --lora R too.")
    if args.params:
        units, shape = synthetic_unit_numels(args.params)
        return SizedModel(units, {}, (shape.layers, shape.d_model, shape.vocab, shape.seq),
                          f"a GPT of {human_count(sum(units))} parameters ({shape.layers} layers, d_model "
                          f"{shape.d_model}, vocab {shape.vocab})", kv_width=shape.d_model)
    if args.lora is not None:
        if not os.path.isdir(args.model):
            raise ValueError("--lora sizes adapters of a Hugging Face model: give --model DIR.")
        hf = HFModel(args.model, args.lora, lora_targets=args.lora_targets, causal_only=False)
        units, layout = unit_layout(hf.build())
        trained = sum(n for n, f in zip(units, layout["frozen"], strict=True) if not f)
        what = (f"{args.model} + LoRA r={args.lora} ({human_count(sum(units))} parameters, "
                f"{human_count(trained)} trained)")
        layout["frozen_in_files"] = True  # the base is read from its weights files, never the swap file
        if args.quantize is not None:  # ... or its quantized blocks from the swap file
            layout["stored"] = quantized_stored(units, layout, args.world_size, args.quantize, args.quantize_double)
            what += f", the base {args.quantize}"
        return SizedModel(units, layout, hf_dims(hf.config()), what, hf=True, kv_width=kv_width(hf.config()))
    source = resolve_model(args.model, causal_only=False)
    units, layout = source_layout(source)
    dims, width = None, None
    if source.gpt is not None:
        dims, width = (source.gpt.layers, source.gpt.d_model, source.gpt.vocab, source.gpt.seq), source.gpt.d_model
    elif os.path.isdir(args.model):
        config = HFModel(args.model).config()
        dims, width = hf_dims(config), kv_width(config)
    return SizedModel(units, layout, dims, f"{args.model} ({human_count(sum(units))} parameters)",
                      hf=os.path.isdir(args.model), kv_width=width)
