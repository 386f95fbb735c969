"""What `outcore train` trains: a GPT preset on byte tokens, or a Hugging Face model from its own
directory (fully, or its LoRA adapters) on text its own tokenizer packs. The loop in train.py sees
only a `Job`: how to build the model, what to give the engine, the data, the loss and the export."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import nn

from outcore.hf.data_mix import DataFile
from outcore.hf.declared_quantization import stored
from outcore.hf.source import HFModel
from outcore.runtime.materialize import deferred_init
from outcore.runtime.units import plan_layout, plan_units
from outcore.tools.activations import Shape
from outcore.tools.corpus import VOCAB, batch_generator, files_corpus, stdlib_corpus
from outcore.tools.model_source import resolve_model, unit_numels
from outcore.tools.presets import PRESETS

log = logging.getLogger(__name__)

# Peak learning rates by size, as GPT-3's table (Brown et al. 2020) gives them; tiny trains fast.
LEARNING_RATES = {"tiny": 2e-3, "gpt-125m": 6e-4, "gpt-350m": 3e-4, "gpt-1b": 2e-4, "gpt-2b": 1.6e-4,
                  "gpt-3b": 1.6e-4, "gpt-7b": 1.2e-4}
DEFAULT_STEPS = {"tiny": 300}
FINE_TUNE_LR, LORA_LR, FINE_TUNE_SEQ = 2e-5, 1e-3, 512


class BatchSource(Protocol):
    """Where a split's batches come from: bytes of text (tools/corpus.py `ByteCorpus`) or packed
    fine-tuning rows (hf/sft_data.py `SFTDataset`)."""

    def batch(self, batch: int, seq: int, generator: torch.Generator, shard: tuple[int, int] = (0, 1)) -> Any:
        """`batch` rows drawn with `generator` (the same draw on every rank), this rank's part for `shard`."""
        ...

    def row_count(self, seq: int) -> int:
        """How many rows of `seq` tokens one pass over it holds (an epoch's)."""
        ...


class Data:
    """Seeded batches of one split."""

    def __init__(self, corpus: BatchSource, batch: int, seq: int, seed: int, split: str) -> None:
        self.corpus, self.batch, self.seq, self.seed, self.split = corpus, batch, seq, seed, split

    def at(self, index: int, shard: tuple[int, int] = (0, 1)) -> Any:
        """Batch `index`: rank r's rows of it for `shard` = (r, world)."""
        return self.corpus.batch(self.batch, self.seq, batch_generator(self.seed, index, self.split), shard)


@dataclass
class Job:
    name: str  # what the summary calls the model: a preset, or the model directory
    params: int  # parameters, frozen ones included
    trainable: int
    seq: int
    steps: int  # the default number of steps
    lr: float  # the default peak learning rate
    build: Callable[[], nn.Module]  # the model, parameters on the meta device
    engine_kw: dict  # init_fn= or weights=
    unit_numels: list[int]  # for choosing the offload setting before anything is built
    train: Data
    held_out: Data
    inputs: Callable[[Any, torch.device], Any]  # (batch, device) -> the forward's args (tuple) or kwargs (dict)
    export: Callable[[Any, str], str] | None  # (engine, run dir) -> what it wrote
    tokens: str  # what a token is, for the report
    checkpoint_activations: bool  # the default
    shape: Shape | None = None  # a decoder's layers, width and vocabulary: its activations' size
    data_lines: tuple[str, ...] = ()  # what each --data file is, to say as the run starts
    layout: dict = field(default_factory=dict)  # what the run keeps of each unit, as `estimate` takes it


def job_loss(engine: Any, job: Job, batch: Any, device: torch.device) -> torch.Tensor:
    """The model's loss on one batch (a Hugging Face output carries it as `.loss`)."""
    args = job.inputs(batch, device)
    output = engine(**args) if isinstance(args, dict) else engine(*args)
    return getattr(output, "loss", output)


def preset_job(preset: str, *, data: tuple[str, ...], batch: int, seq: int | None, seed: int) -> Job:
    source = resolve_model(preset, seq=seq)
    gpt = source.gpt
    if gpt is None:
        raise ValueError(f"--preset {preset!r}: train takes a preset ({', '.join(PRESETS)}) or --model DIR.")
    if gpt.vocab < VOCAB:
        raise ValueError(f"preset {preset!r} has a vocabulary of {gpt.vocab}; byte tokens need {VOCAB}.")
    train_set, held_out = files_corpus(list(data)) if data else stdlib_corpus()

    def inputs(xy, device):
        x, y = xy
        return x.to(device), y.to(device)

    def build() -> nn.Module:
        with deferred_init():
            return source.build()

    return Job(preset, gpt.params, gpt.params, gpt.seq, DEFAULT_STEPS.get(preset, 1000),
               LEARNING_RATES.get(preset, 3e-4), build, {"init_fn": source.init_fn}, unit_numels(source),
               Data(train_set, batch, gpt.seq, seed, "train"), Data(held_out, batch, gpt.seq, seed, "val"), inputs,
               None, f"bytes of {train_set.name}", gpt.layers >= 24, Shape(gpt.layers, gpt.d_model, gpt.vocab))


@dataclass(frozen=True)
class DataOptions:
    """How `--data` becomes what a fine-tune trains on (hf/sft_data.py, hf/data_mix.py)."""

    files: tuple[DataFile, ...]
    chat_template: str | None = None  # a Jinja file in place of the tokenizer's own template
    completion_only: bool = True  # False: every token carries the loss (--train-on-prompt)
    packing: bool = True
    eval_data: str | None = None  # held-out rows of their own; else a split of --data
    eval_split: float = 0.05


def hf_job(directory: str, *, lora: int | None, data: DataOptions | None, batch: int, seq: int | None, seed: int,
           merge: bool = False, lora_alpha: int | None = None, lora_targets: tuple[str, ...] | None = None,
           lora_init: str | None = None, dora: bool = False) -> Job:
    source = HFModel(directory, lora, lora_alpha, lora_targets, lora_init, dora)
    if data is None:
        raise ValueError("--model DIR fine-tunes on your data: give --data FILE (.jsonl, .json, .parquet, .txt, or "
                         "a save_to_disk directory).")
    config = source.config()
    positions = getattr(config, "max_position_embeddings", None)
    seq = seq or min(FINE_TUNE_SEQ, positions or FINE_TUNE_SEQ)
    if isinstance(positions, int) and seq > positions:  # learned positions would fail deep in the forward
        raise ValueError(f"--seq {seq} is longer than the {positions} positions {directory!r} has "
                         f"(max_position_embeddings in its config.json); give --seq {positions} or less.")
    tokenizer = source.tokenizer()
    train_set, held_out, data_lines = fine_tuning_data(data, tokenizer, seq, seed)
    vocab = getattr(config, "vocab_size", None)
    largest = max(i for ds in (train_set, held_out) for row in ds.rows for s in row for i in s.input_ids)
    added = isinstance(vocab, int) and tokenizer.vocab_size <= vocab < len(tokenizer)  # added to the model's own
    if isinstance(vocab, int) and added and largest >= vocab:  # and used: the model's vocabulary grows for them
        log.warning("the tokenizer in %s has %d tokens and the model %d, and --data uses the added ones: the model's "
                    "vocabulary is resized to %d%s", directory, len(tokenizer), vocab, len(tokenizer),
                    ", and LoRA trains the new tokens' rows (peft's trainable_token_indices)" if lora else "")
        source = replace(source, vocab_size=len(tokenizer))
    elif isinstance(vocab, int) and largest >= vocab:  # the embedding would fail deep in the forward
        raise ValueError(f"the tokenizer in {directory!r} gives token id {largest} on --data, but the model's "
                         f"vocabulary is {vocab} tokens (vocab_size in its config.json); the directory needs the "
                         "model's own tokenizer.")
    with_lora = source.build()
    plans = plan_units(with_lora)
    _, layout = plan_layout(plans)
    params = sum(s.numel for p in plans for s in p.slots)
    trainable = sum(s.numel for p in plans for s in p.slots if not s.frozen)

    def inputs(rows, device):
        # Packed rows: transformers masks attention per sample from position_ids, with no key/value
        # cache (training keeps none; asked for one, it turns it off under checkpointing, warning).
        return {**{k: v.to(device) for k, v in rows.items()}, "use_cache": False}

    def export(engine, out: str) -> str:
        """OUT/adapters for LoRA; OUT/model, with the tokenizer, for a full fine-tune or LoRA merged."""
        if lora:
            adapters = os.path.join(out, "adapters")
            engine.export(adapters, adapters_only=True)
            if not merge:
                return adapters
        path = os.path.join(out, "model")
        engine.export(path, merge_adapters=merge)
        if engine.group.rank == 0:  # (every rank exports; rank 0 writes)
            tokenizer.save_pretrained(path)  # the directory loads as a model of its own
        return path

    built = [with_lora]

    def build() -> nn.Module:  # the model planned above, built once
        return built.pop() if built else source.build()

    name = os.path.basename(os.path.normpath(directory)) + (f" + LoRA r={lora}" if lora else "")
    c = train_set.counts
    left_out = f"; {c.dropped} rows left out (see the warning above)" if c.dropped else ""
    names = ", ".join(f.path for f in data.files)
    tokens = (f"tokens of {names} ({c.samples} samples, {len(train_set)} rows; "
              f"{100 * c.trained / max(c.tokens, 1):.0f}% of tokens carry the loss{left_out})")
    return Job(name, params, trainable, seq, 100, LORA_LR if lora else FINE_TUNE_LR, build, {"weights": directory},
               [sum(s.numel for s in p.slots) for p in plans],
               Data(train_set, batch, seq, seed, "train"), Data(held_out, batch, seq, seed, "val"), inputs, export,
               tokens, True, _shape(config),  # activations are most of a fine-tune's memory
               tuple(data_lines), {**layout, "frozen_in_files": True,  # a frozen base is read from its files
                                   "stored_as": _stored_as(directory)})


def _stored_as(directory: str) -> tuple[str, bool] | None:
    """How a pre-quantized directory's files hold its base (kind, double quantization), or None."""
    held = stored(directory)
    return next(iter(held)) if len(held) == 1 else None


def _shape(config: Any) -> Shape | None:
    """A Hugging Face decoder's shape, where its config names it the common way."""
    layers, width, vocab = (getattr(config, k, None) for k in ("num_hidden_layers", "hidden_size", "vocab_size"))
    if isinstance(layers, int) and isinstance(width, int) and isinstance(vocab, int):
        return Shape(layers, width, vocab)
    return None


def fine_tuning_data(data: DataOptions, tokenizer: Any, seq: int, seed: int) -> tuple[Any, Any, list[str]]:
    """The training rows and the held-out rows, labelled and packed alike (hf/sft_data.py), from one
    file or several mixed (hf/data_mix.py); and a line saying what each file is."""
    from outcore.hf.data_files import read_rows, read_text
    from outcore.hf.data_mix import FileSamples, mixed
    from outcore.hf.sft_data import held_out, packed, samples_of

    template = None
    if data.chat_template is not None:
        try:
            template = read_text(data.chat_template, "--chat-template ")
        except OSError as e:
            raise ValueError(f"--chat-template {data.chat_template!r}: {e.strerror}.") from e
    kw: dict[str, Any] = {"completion_only": data.completion_only, "chat_template": template}
    parts, evals, cut, dropped, formats = [], [], 0, 0, []
    for file in data.files:
        samples, fmt, file_cut, file_dropped = samples_of(read_rows(file.path), file.path, tokenizer, seq, **kw)
        if data.eval_data is None:
            samples, file_evals = held_out(samples, data.eval_split, seed, file.path)
            evals += file_evals
        parts.append(FileSamples(file.path, fmt, samples, file.weight))
        cut, dropped = cut + file_cut, dropped + file_dropped
        formats.append(fmt)
    samples, counts = mixed(parts, seed)
    lines = [p.describe(n if p.weight is not None else None) for p, n in zip(parts, counts, strict=True)]
    name = ", ".join(f.path for f in data.files)
    fmt = formats[0] if len(set(formats)) == 1 else "mixed"
    if data.eval_data is not None:
        evals, eval_fmt, eval_cut, eval_dropped = samples_of(read_rows(data.eval_data), data.eval_data, tokenizer,
                                                             seq, **kw)
        eval_name = data.eval_data
    else:
        eval_fmt, eval_cut, eval_dropped, eval_name = fmt, 0, 0, f"{name} (held out)"
    return (packed(samples, seq, tokenizer, fmt, name, packing=data.packing, truncated=cut, dropped=dropped),
            packed(evals, seq, tokenizer, eval_fmt, eval_name, packing=data.packing, truncated=eval_cut,
                   dropped=eval_dropped), lines)
