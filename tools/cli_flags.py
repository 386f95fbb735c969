"""The `outcore` command line's flags: every command's parser, the types that read its values, and
the help that says what each does and its default. `cli.py` dispatches; nothing here runs a command."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import NoReturn, TypeVar

from outcore.runtime.config import MIN_SUB_GROUP_SIZE, SEEDS
from outcore.runtime.policy import ACTIVATION_OFFLOADS, OFFLOADS, STATE_DTYPES
from outcore.tools.arg_types import (
    int_in,
    non_negative_float,
    non_negative_int,
    parse_count,
    parse_list,
    parse_size,
    positive_float,
    positive_int,
    step_count,
)
from outcore.tools.lr_schedules import DEFAULT as DEFAULT_SCHEDULE
from outcore.tools.lr_schedules import DEFAULT_MIN_LR_RATE, SCHEDULES
from outcore.tools.presets import PRESETS

T = TypeVar("T")
EXIT_USAGE = 2
PRESET_NAMES = [name for name in PRESETS if not name.startswith("bench")]


def _typed(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type from a parser raising ValueError, whose words reach the user (argparse
    would print only the parser's name)."""
    def typed(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    typed.__name__ = parse.__name__
    return typed


_size, _count = _typed(parse_size), _typed(parse_count)
_sizes = _typed(lambda text: parse_list(text, parse_size))
_ints = _typed(lambda text: parse_list(text, int))
_words = _typed(lambda text: parse_list(text, str.strip))


@_typed
def _sub_group_size(text: str) -> int:
    value = parse_count(text)
    if value < MIN_SUB_GROUP_SIZE:
        raise ValueError(f"{text!r}: an optimizer chunk is at least {MIN_SUB_GROUP_SIZE} elements")
    return value


class _OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line (not the whole usage) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def _lora_targets(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora-targets", type=_module_names, metavar="NAMES",
                        help="with --lora: the modules to adapt, by name, e.g. q_proj,v_proj (default: every "
                        "linear module)")


_module_names = _typed(lambda text: tuple(parse_list(text, str.strip)))


def _lora_init_name(text: str) -> str:
    if text in ("gaussian", "pissa", "olora", "orthogonal") or re.fullmatch(r"pissa_niter_[1-9][0-9]*", text):
        return text
    raise ValueError(f"{text!r} is not one of gaussian, pissa, pissa_niter_N, olora, orthogonal")


_lora_init = _typed(_lora_init_name)


def given_flags(argv: list[str]) -> set[str]:
    """The destinations of the flags `argv` (a command's arguments) names itself, defaults left out."""
    parser = build_parser()
    for action in _subparsers(parser):
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv))) - {"command"}


def command_actions(command: str) -> dict[str, argparse.Action]:
    """The flags of one command of the parser, by destination."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {action.dest: action for action in sub.choices[command]._actions if action.dest != "help"}


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += sub._actions
    return found


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="outcore", description="Offload-first, out-of-core training for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)

    b = sub.add_parser("bench-disk", help="read/write throughput of a directory per I/O setting")
    b.add_argument("--dir", required=True, help="directory on the disk to measure")
    b.add_argument("--size", type=_size, default=parse_size("4G"), help="file size (default 4G)")
    b.add_argument("--block-size", type=_sizes, default=_sizes("128K,1M,8M"),
                   help="request sizes to try, comma-separated (default 128K,1M,8M)")
    b.add_argument("--queue-depth", type=_ints, default=_ints("1,8,32"),
                   help="requests in flight to try (default 1,8,32)")
    b.add_argument("--threads", type=_ints, default=_ints("1,2,4"), help="I/O threads to try (default 1,2,4)")
    b.add_argument("--direct", action=argparse.BooleanOptionalAction, default=True,
                   help="O_DIRECT, past the page cache, as the store reads and writes (default on)")
    b.add_argument("--backend", type=_words, default=_words("threads,aiofiles"),
                   help="I/O backends to compare (default threads,aiofiles)")
    b.add_argument("--repeats", type=positive_int, default=1, help="interleaved runs per setting; medians reported")
    b.add_argument("--no-fio", action="store_true", help="skip the fio reference even if fio is on PATH")
    b.add_argument("--json", metavar="PATH", help="also write the results as JSON")

    about = ("train a GPT preset on text, or fine-tune a Hugging Face model (fully or with LoRA) on your data as SFT "
             "tools do")
    t = sub.add_parser("train", help=about, description=about[0].upper() + about[1:] + ".")
    t.add_argument("--preset", help=f"model size: {', '.join(PRESET_NAMES)} (default tiny)")
    t.add_argument("--model", metavar="DIR", help="fine-tune the Hugging Face model in DIR (its weights and "
                   "tokenizer) in place of a preset; needs --data")
    t.add_argument("--lora", type=positive_int, metavar="R", help="with --model: train LoRA adapters of rank R only")
    t.add_argument("--lora-alpha", type=positive_int, metavar="A",
                   help="with --lora: peft's lora_alpha, the adapters' scale A/R (default 2R)")
    _lora_targets(t)
    t.add_argument("--lora-init", type=_lora_init, metavar="INIT",
                   help="with --lora: peft's init_lora_weights, computed as each layer's weights are read: gaussian, "
                   "pissa, pissa_niter_N, olora or orthogonal (default: A random, B zero)")
    t.add_argument("--dora", action="store_true", help="with --lora: DoRA, peft's use_dora")
    t.add_argument("--quantize", choices=("nf4", "fp4", "int8"), help="with --lora: QLoRA, the frozen base's Linear "
                   "weights stored in the tiers as bitsandbytes stores them, 4-bit (a quarter of bf16's bytes) or "
                   "8-bit (half), dequantized as each block is used (needs the qlora extra)")
    t.add_argument("--quantize-double", action="store_true",
                   help="with --quantize nf4|fp4: quantize the 4-bit weights' scales too (bitsandbytes' double "
                   "quantization)")
    t.add_argument("--merge-adapters", action="store_true", help="with --lora: besides OUT/adapters, export OUT/model, "
                   "the model with the adapters merged into its weights (from_pretrained loads it alone)")
    t.add_argument("--config", help="an outcore.Config file (.json/.yaml/.toml), e.g. from `outcore tune`")
    t.add_argument("--steps", type=step_count, help="optimizer steps; with --epochs, the most it may take "
                   "(default: 300 for tiny, 1000 for the other presets, 100 with --model)")
    t.add_argument("--epochs", type=positive_float, metavar="E", help="train E passes over the training rows "
                   "(E x rows / (batch x accumulate x ranks) steps, rounded up), capped by --steps")
    t.add_argument("--data", action="append", metavar="FILE[:W]", help="a preset trains on UTF-8 text files "
                   "(default: the Python standard library's sources); --model on .jsonl/.json/.parquet/.txt or "
                   "save_to_disk directories of text, messages, prompt-completion, Alpaca or ShareGPT rows. Repeat it "
                   "to train on several: concatenated, or with --model mixed by weight W (FILE:W, the share of "
                   "samples drawn from it; default: concatenation)")
    t.add_argument("--chat-template", metavar="FILE", help="with --model: a Jinja chat template in place of the "
                   "tokenizer's own")
    t.add_argument("--train-on-prompt", action="store_true", help="with --model: every token carries the loss "
                   "(default: only assistant turns, completions and Alpaca outputs)")
    t.add_argument("--no-packing", action="store_true", help="with --model: one sample a row, padded (default: "
                   "samples packed into rows, attention masked per sample)")
    t.add_argument("--eval-data", metavar="FILE", help="with --model: held-out rows to evaluate on (default: a "
                   "split of --data)")
    t.add_argument("--eval-split", type=positive_float, default=0.05, metavar="F",
                   help="with --model and no --eval-data: the fraction of --data held out (default 0.05)")
    t.add_argument("--out", default="outcore-run", help="run directory: checkpoints/ (default outcore-run)")
    t.add_argument("--nvme-dir", help="where swap files go (default: a temporary folder under the working dir)")
    t.add_argument("--offload-params", choices=OFFLOADS, help="default: the least that fits free memory")
    t.add_argument("--offload-optimizer", choices=OFFLOADS, help="where the fp32 master weights and Adam moments "
                   "rest (default: the least that fits free memory)")
    t.add_argument("--offload-activations", choices=ACTIVATION_OFFLOADS,
                   help="where what autograd keeps for backward outside the checkpointed layers goes: the store's "
                   "host tier (cpu), the swap file (nvme), or nowhere (none); default auto: paged past half of "
                   "the free memory")
    t.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="default: bf16 where native, else fp32")
    t.add_argument("--state-dtype", choices=STATE_DTYPES, help="Adam moments (and a master kept apart from the "
                   "parameters) in fp32, or in bf16: half the optimizer's bytes, rounded stochastically "
                   "(default: the config's, fp32)")
    t.add_argument("--batch", type=positive_int, default=8, help="sequences per micro-batch (default 8)")
    t.add_argument("--seq", type=positive_int, help="context length (default: the preset's)")
    t.add_argument("--accumulate", type=positive_int, metavar="K",
                   help="K micro-batches per optimizer step, each unit read once for all K (Engine.train_batch)")
    t.add_argument("--lr", type=positive_float, help="peak learning rate (default: 2e-3 for tiny, 6e-4 to 1.2e-4 "
                   "for the larger presets by size, 2e-5 for a full fine-tune with --model, 1e-3 with --lora)")
    t.add_argument("--lr-scheduler", choices=tuple(SCHEDULES), metavar="NAME",
                   help="the rate's schedule, as transformers' lr_scheduler_type names and computes it: "
                   f"{', '.join(SCHEDULES)} (default {DEFAULT_SCHEDULE}: linear warm-up, then cosine to "
                   "--min-lr-rate of the peak)")
    t.add_argument("--warmup-steps", type=non_negative_int, metavar="N", help="steps of linear warm-up from 0 "
                   "(default: a tenth of the run, at most 100; none below 10 steps)")
    t.add_argument("--warmup-ratio", type=non_negative_float, metavar="F",
                   help="the warm-up as a fraction of the run, rounded up (in place of --warmup-steps)")
    t.add_argument("--min-lr-rate", type=non_negative_float, metavar="F", default=DEFAULT_MIN_LR_RATE,
                   help=f"with cosine_with_min_lr: the floor, a fraction of the peak (default {DEFAULT_MIN_LR_RATE})")
    t.add_argument("--weight-decay", type=non_negative_float, metavar="WD",
                   help="AdamW's decoupled weight decay, on weights, not biases or norms (default: 0.1 for a full "
                   "run, 0 with --lora)")
    t.add_argument("--adam-beta1", type=non_negative_float, metavar="B1", help="AdamW's beta1 (default 0.9)")
    t.add_argument("--adam-beta2", type=non_negative_float, metavar="B2", help="AdamW's beta2 (default 0.95)")
    t.add_argument("--grad-clip", type=non_negative_float, default=1.0,
                   help="global norm clip; 0 turns it off (default 1.0)")
    t.add_argument("--host-budget", type=_size, help="bytes of host memory for the store (default: derived)")
    t.add_argument("--device-budget", type=_size, help="bytes of device memory for the store (default: derived; "
                   "on a CPU-only machine the compute device is the CPU)")
    t.add_argument("--prefetch-depth", type=non_negative_int, help="units fetched ahead of use (default 2)")
    t.add_argument("--eval-every", type=positive_int, help="steps between validation losses (default: 5 per run)")
    t.add_argument("--max-memory", type=_size, metavar="SIZE", help="host memory the whole run may use: this "
                   "process, the store's budgets (a derived host budget is lowered to fit) and a step's activations, "
                   "checked before step 1 (default: what the machine has available)")
    t.add_argument("--log-every", type=positive_int, default=10, metavar="N",
                   help="steps per row of OUT/log.jsonl and per console line (default 10); a line comes at least "
                   "every 60 s too, with the time left. Both say `loss`: the mean of the steps' training losses "
                   "since the previous row of OUT/log.jsonl")
    t.add_argument("--report-to", type=_words, default=(), metavar="TRACKERS",
                   help="also log to tensorboard (OUT/tensorboard) and/or wandb (offline unless WANDB_MODE says "
                   "otherwise), comma-separated (default: OUT/log.jsonl alone)")
    t.add_argument("--eval-batches", type=positive_int, default=4,
                   help="held-out batches each validation loss averages (default 4)")
    t.add_argument("--save-every", type=positive_int, help="also checkpoint every N steps (the last step always is)")
    t.add_argument("--no-save", action="store_true", help="do not write the final checkpoint")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out, with the "
                   "arguments OUT/run.json recorded (a flag given again that changes what is trained is refused; "
                   "steps, budgets, logging and the schedule may change, and are said)")
    t.add_argument("--tag", help="with --resume: the checkpoint to continue from (default: the latest)")
    t.add_argument("--data-changed-ok", action="store_true", help="with --resume: go on though a data file's bytes "
                   "differ from what the run recorded as it started (said, naming the file; default: refused)")
    t.add_argument("--loss-chunk-tokens", type=non_negative_int, metavar="N", help="with --model: the head and the "
                   "loss computed N tokens at a time, forward and backward, never the whole logits (default: chosen "
                   "from the vocabulary; 0: the whole logits)")
    t.add_argument("--tile-tokens", type=non_negative_int, metavar="N", help="with --model: each decoder layer's "
                   "MLP computed N tokens of the sequence at a time, forward and backward (default: tiles where one "
                   "block's MLP would pass a sixteenth of the memory; 0: untiled)")
    t.add_argument("--checkpoint-activations", action=argparse.BooleanOptionalAction,
                   help="recompute blocks in backward (default: on for 24 layers and more)")
    t.add_argument("--seed", type=int_in(SEEDS), default=0,
                   help="the model's initialization, the batches drawn and the held-out split (default 0)")
    t.add_argument("--timeout", type=positive_float, metavar="SECONDS",
                   help="how long a collective waits for a stalled rank before every rank stops (default 600)")
    t.add_argument("--json", metavar="PATH", help="also write the run's summary as JSON")

    e = sub.add_parser("estimate", help="per-tier bytes per rank for a model, stage and offload setting")
    which = e.add_mutually_exclusive_group(required=True)
    which.add_argument("--params", type=_count, help="parameter count, e.g. 13B (a GPT of that size)")
    which.add_argument("--model", help=f"a preset ({', '.join(PRESET_NAMES)}), a Hugging Face model directory "
                       "(sized from its config.json) or module:factory")
    e.add_argument("--lora", type=positive_int, metavar="R", help="with --model DIR: LoRA adapters of rank R on every "
                   "linear layer, the rest frozen (no gradient or optimizer state)")
    _lora_targets(e)
    e.add_argument("--quantize", choices=("nf4", "fp4", "int8"), help="with --lora: the frozen base stored 4-bit or "
                   "8-bit in the tiers (Config.quantize): its block weights counted at their stored bytes")
    e.add_argument("--quantize-double", action="store_true", help="with --quantize: the scales quantized too")
    e.add_argument("--world-size", type=positive_int, default=1,
                   help="data-parallel ranks the states are sharded over (default 1)")
    e.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="compute dtype (default: as `outcore train` "
                   "picks it, bf16 where the device computes it natively, else fp32)")
    e.add_argument("--state-dtype", choices=STATE_DTYPES, default="fp32",
                   help="optimizer states in fp32 or bf16 (default fp32)")
    e.add_argument("--stage", type=int, choices=(1, 2, 3), help="one ZeRO stage (default: every stage)")
    e.add_argument("--offload-params", choices=OFFLOADS, help="one placement of the parameter shards (default: "
                   "every one the stage allows)")
    e.add_argument("--offload-optimizer", choices=OFFLOADS, help="one placement of the optimizer states (default: "
                   "every one)")
    e.add_argument("--prefetch-depth", type=non_negative_int, default=2, help="units fetched ahead of use (default 2)")
    e.add_argument("--device", choices=("cuda", "cpu"),
                   help="where compute runs (default: cuda where this machine has it, else cpu); cpu: DEVICE is RAM "
                   "too, and the whole prefetch window is on it")
    e.add_argument("--nvme-dir", default=".", help="where swap files would go: the verdict checks its disk's free "
                   "space, and --predict measures it when no --disk is given (default .)")
    e.add_argument("--sub-group-size", type=_sub_group_size, default=1 << 22,
                   help="elements per optimizer chunk (default 4M)")
    e.add_argument("--grad-clip", type=non_negative_float, default=1.0, help="0: no clipping (gradients then stream)")
    e.add_argument("--accumulate", type=positive_int, metavar="K", help="also size the activation keys a "
                   "train_batch of K micro-batches keeps (needs --batch and --seq, and a GPT shape or model directory)")
    e.add_argument("--batch", type=positive_int, help="sequences per micro-batch: sizes the step's "
                   "activations (and with --accumulate the activation keys) (default 1)")
    e.add_argument("--seq", type=positive_int, help="context length of the activations sized (default: the "
                   "model's)")
    e.add_argument("--max-seq", action="store_true", help="also say the longest --seq whose activations fit beside "
                   "the verdict's budgets (this machine's memory, or --max-memory), with the flags")
    e.add_argument("--max-memory", type=_size, metavar="SIZE", help="with --max-seq or --generate: the memory the run "
                   "may take, in place of what this machine has available")
    e.add_argument("--generate", type=positive_int, metavar="TOKENS", help="also say the KV cache a generated "
                   "sequence of TOKENS tokens (prompt and completion) holds, and the largest generation batch "
                   "(GRPO's prompts x num_generations) whose cache fits beside the verdict's budgets")
    e.add_argument("--json", metavar="PATH", help="also write the estimate as JSON")
    pr = e.add_argument_group("step prediction (--predict; one stage and offload setting)")
    pr.add_argument("--predict", action="store_true", help="predict the step: its time by kind of work, what "
                   "bounds it, tokens/s and MFU, and the accumulation at which compute bounds it (needs --batch); "
                   "for --stage/--offload-params/--offload-optimizer, or the setting the verdict recommends")
    pr.add_argument("--device-budget", type=_size, help="DEVICE budget the run will have (default: derived)")
    pr.add_argument("--host-budget", type=_size, help="HOST budget the run will have (default: derived)")
    pr.add_argument("--checkpoint-activations", action="store_true", help="the run recomputes each block's forward")
    pr.add_argument("--vertical", action="store_true", help="each step one train_batch of --accumulate micro-batches")
    pr.add_argument("--disk", metavar="JSON", help="the disk's rates from `outcore bench-disk --json` (default: "
                   "measured now in --nvme-dir)")
    pr.add_argument("--flops", type=float, help="FLOP/s the compute reaches (default: a matrix product measured now)")
    pr.add_argument("--peak-flops", type=float, help="the device's peak FLOP/s, for MFU (default: --flops)")
    pr.add_argument("--overhead", type=non_negative_float, metavar="SECONDS", help="what a step costs beyond its "
                    "work: Python, the hooks, the I/O requests (default: measured now on a model as deep, of width 16)")
    pr.add_argument("--eval-every", type=positive_int, metavar="N", help="also say what outcore train's evaluation "
                    "adds a step, every N steps")
    pr.add_argument("--eval-batches", type=positive_int, default=4, help="held-out batches an evaluation runs "
                    "(default 4)")
    pr.add_argument("--adam-rate", type=float, help="trained parameters/s the engine's update path handles: casts, "
                    "the norm, AdamW, the copies back (default: measured now on an engine, unless --overhead is given)")
    pr.add_argument("--no-checksum", action="store_true", help="the run turns the swap file's checksums off "
                    "(IOConfig(checksum=False)): on a CPU their time is not counted")
    pr.add_argument("--host-device-rate", type=float, help="bytes/s between host memory and the GPU (default 25e9 "
                   "with --device cuda)")

    x = sub.add_parser("export", help="consolidate a sharded checkpoint into one safetensors file or an HF directory")
    x.add_argument("checkpoint", help="a checkpoint directory (its latest tag is used) or a tag folder")
    x.add_argument("out", help="the .safetensors file to write, or a directory for the Hugging Face layout")
    x.add_argument("--max-shard-size", type=_size, default=5_000_000_000,
                   help="with a directory: bytes per shard at most (default 5G)")
    x.add_argument("--tag", help="which tag of the checkpoint directory (default: latest)")
    x.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="parameter dtype (default: the run's)")
    x.add_argument("--no-verify", action="store_true", help="skip the crc32 check of the rank files")
    x.add_argument("--merge-adapters", action="store_true", help="a LoRA run's checkpoint: the model with the "
                   "adapters merged into its weights, under its own names (from_pretrained loads it alone)")
    x.add_argument("--tokenizer", metavar="DIR", help="a directory export: save the tokenizer of DIR beside it "
                   "(default: the model directory the run came from, where the checkpoint records one)")
    x.add_argument("--json", metavar="PATH", help="also write what was written as JSON")

    u = sub.add_parser("tune", help="sweep prefetch and I/O settings on the real model; write the fastest, where it "
                       "beats the given config")
    u.add_argument("--config", required=True, help="the starting outcore.Config file (its budgets are the limits)")
    u.add_argument("--model", default="tiny", help=f"a preset ({', '.join(PRESET_NAMES)}), a Hugging Face model "
                   "directory (its weights; random token ids) or module:factory (default tiny)")
    u.add_argument("--steps", type=step_count, default=3, help="timed steps per candidate, after one warm-up "
                   "step (default 3)")
    u.add_argument("--batch", type=positive_int, default=1, help="sequences per step (default 1)")
    u.add_argument("--seq", type=positive_int, help="context length (default: the preset's)")
    u.add_argument("--out", default="tuned.json",
                   help="where the fastest config is written, as .json, .yaml or .toml (default tuned.json)")
    u.add_argument("--prefetch-depth", type=_ints, help="values to try (default 1,2,4)")
    u.add_argument("--block-size", type=_sizes, help="values to try (default 1M,8M)")
    u.add_argument("--queue-depth", type=_ints, help="values to try (default 8,32)")
    u.add_argument("--threads", type=_ints, help="values to try (default 2,4,8)")
    u.add_argument("--nice", type=_ints, help="background threads' nice levels below compute, to try (default 0,15)")
    u.add_argument("--no-prune", action="store_true",
                   help="run every candidate, even those the step prediction shows cannot win (it measures the "
                        "disk, compute and AdamW rates first, about 15 s)")
    u.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds each phase's candidates, and "
                   "at the end the winner against the given config, are measured in (default 3)")
    u.add_argument("--max-rss", type=_size, help="reject candidates whose peak RSS is above this")
    u.add_argument("--timeout", type=positive_float, default=1800, help="seconds per candidate (default 1800)")
    u.add_argument("--json", metavar="PATH", help="also write every candidate's figures as JSON")
    return p
