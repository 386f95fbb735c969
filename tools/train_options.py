"""`outcore train`'s options: what the command line's flags (or a Python caller) ask of a run."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from outcore.tools.lr_schedules import DEFAULT_MIN_LR_RATE
from outcore.tools.run_record import NOT_RECORDED


@dataclass
class TrainOptions:
    preset: str = "tiny"
    model: str | None = None  # a Hugging Face model directory, in place of the preset
    lora: int | None = None  # with `model`: train LoRA adapters of this rank
    merge_adapters: bool = False  # with `lora`: also export the base model with the adapters merged in
    lora_alpha: int | None = None  # with `lora`: peft's lora_alpha (None: twice the rank)
    lora_targets: tuple[str, ...] | None = None  # with `lora`: the modules adapted (None: every linear one)
    lora_init: str | None = None  # with `lora`: peft's init_lora_weights (None: its default)
    dora: bool = False  # with `lora`: peft's use_dora
    quantize: str | None = None  # with `lora`: the frozen base stored quantized (Config.quantize)
    quantize_double: bool = False  # with `quantize`: its scales quantized too
    config: str | None = None  # a runtime.Config file; the flags below override what it says
    steps: int | None = None  # with `epochs`: the most steps the run may take
    epochs: float | None = None  # passes over the training rows
    data: tuple[str, ...] = ()  # FILE or FILE:W (hf/data_mix.py); () : the preset's default corpus
    chat_template: str | None = None  # with `model`: a Jinja file in place of the tokenizer's chat template
    train_on_prompt: bool = False  # with `model`: every token carries the loss, not only the completions
    packing: bool = True  # with `model`: samples packed into rows (False: one sample a row, padded)
    eval_data: str | None = None  # with `model`: held-out rows of their own (None: a split of `data`)
    eval_split: float = 0.05  # with `model` and no `eval_data`: the fraction of `data` held out
    out: str = "outcore-run"
    nvme_dir: str | None = None
    offload_params: str | None = None  # None: chosen from free memory
    offload_optimizer: str | None = None
    offload_activations: str | None = None  # None: the config's (auto)
    dtype: str | None = None  # None: bf16 where native, else fp32
    state_dtype: str | None = None  # None: the config's (fp32)
    batch: int = 8
    seq: int | None = None  # None: the preset's context length
    lr: float | None = None
    lr_scheduler: str | None = None  # transformers' name (tools/lr_schedules.py); None: outcore's default
    warmup_steps: int | None = None
    warmup_ratio: float | None = None
    min_lr_rate: float = DEFAULT_MIN_LR_RATE  # with cosine_with_min_lr
    weight_decay: float | None = None  # None: the config's, else 0.1 for a full run and 0 for LoRA
    adam_beta1: float | None = None
    adam_beta2: float | None = None
    grad_clip: float | None = 1.0
    host_budget: int | None = None
    device_budget: int | None = None
    prefetch_depth: int | None = None
    eval_every: int | None = None  # None: five times per run
    eval_batches: int = 4
    save_every: int | None = None
    save_final: bool = True
    resume: bool = False
    resume_tag: str | None = None  # with `resume`: which checkpoint (None: the latest)
    seed: int = 0
    checkpoint_activations: bool | None = None  # None: on for 24 layers and more
    loss_chunk_tokens: int | None = None  # with --model: the loss computed over chunks of this many tokens
    tile_tokens: int | None = None  # with --model: each decoder MLP computed over tiles of this many tokens
    collective_timeout: float | None = None  # seconds a collective waits for a stalled rank
    accumulate: int | None = None  # micro-batches per step through Engine.train_batch
    log_every: int = 10  # steps per row of OUT/log.jsonl (and per line when the output is not a terminal)
    max_memory: int | None = None  # bytes the run may use (None: what the machine has available)
    report_to: tuple[str, ...] = ()  # trackers besides OUT/log.jsonl: tensorboard, wandb
    overrides: dict = field(default_factory=dict)
    arguments: dict | None = None  # the command's arguments, recorded in OUT/run.json as the run starts


def options_from_args(args: argparse.Namespace) -> TrainOptions:
    """`outcore train`'s arguments as the TrainOptions `train()` takes."""
    return TrainOptions(
        preset=args.preset or "tiny", model=args.model, lora=args.lora, merge_adapters=args.merge_adapters,
        lora_alpha=args.lora_alpha, lora_targets=args.lora_targets, lora_init=args.lora_init, dora=args.dora,
        quantize=args.quantize, quantize_double=args.quantize_double, config=args.config, steps=args.steps,
        epochs=args.epochs, data=tuple(args.data or ()), chat_template=args.chat_template,
        train_on_prompt=args.train_on_prompt, packing=not args.no_packing, eval_data=args.eval_data,
        eval_split=args.eval_split, out=args.out, nvme_dir=args.nvme_dir, offload_params=args.offload_params,
        offload_optimizer=args.offload_optimizer, offload_activations=args.offload_activations, dtype=args.dtype,
        state_dtype=args.state_dtype, batch=args.batch, seq=args.seq, lr=args.lr, lr_scheduler=args.lr_scheduler,
        warmup_steps=args.warmup_steps, warmup_ratio=args.warmup_ratio, min_lr_rate=args.min_lr_rate,
        weight_decay=args.weight_decay, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        grad_clip=args.grad_clip or None,
        host_budget=args.host_budget, device_budget=args.device_budget, prefetch_depth=args.prefetch_depth,
        eval_every=args.eval_every, eval_batches=args.eval_batches, save_every=args.save_every,
        save_final=not args.no_save, resume=args.resume, resume_tag=args.tag,
        checkpoint_activations=args.checkpoint_activations, loss_chunk_tokens=args.loss_chunk_tokens,
        tile_tokens=args.tile_tokens, seed=args.seed,
        collective_timeout=args.timeout, accumulate=args.accumulate, log_every=args.log_every,
        report_to=tuple(args.report_to),
        max_memory=args.max_memory, arguments={k: v for k, v in vars(args).items() if k not in NOT_RECORDED})
