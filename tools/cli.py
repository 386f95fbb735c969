"""The `outcore` command line: parse, call an importable function, print. No logic lives here."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

from outcore.runtime.config import MIN_SUB_GROUP_SIZE, SEEDS
from outcore.runtime.policy import OFFLOADS
from outcore.tools.interrupts import Interrupted, handle_signals
from outcore.tools.presets import PRESETS
from outcore.tools.units import (
    human_bytes,
    human_count,
    int_in,
    non_negative_float,
    non_negative_int,
    parse_count,
    parse_list,
    parse_size,
    positive_float,
    positive_int,
)

T = TypeVar("T")
EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2
PRESET_NAMES = [name for name in PRESETS if not name.startswith("bench")]


class UsageError(Exception):
    """A user mistake: printed as one line, exit status 2."""


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
    b.set_defaults(run=_bench_disk)

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
    t.add_argument("--merge-adapters", action="store_true", help="with --lora: besides OUT/adapters, export OUT/model, "
                   "the model with the adapters merged into its weights (from_pretrained loads it alone)")
    t.add_argument("--config", help="an outcore.Config file (.json/.yaml/.toml), e.g. from `outcore tune`")
    t.add_argument("--steps", type=positive_int, help="optimizer steps (default: 300 for tiny, 1000 for the other "
                   "presets, 100 with --model)")
    t.add_argument("--data", help="a preset trains on a UTF-8 text file (default: the Python standard library's "
                   "sources); --model on .jsonl/.json/.parquet/.txt or a save_to_disk directory of text, messages, "
                   "prompt-completion, Alpaca or ShareGPT rows")
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
    t.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="default: bf16 where native, else fp32")
    t.add_argument("--batch", type=positive_int, default=8, help="sequences per micro-batch (default 8)")
    t.add_argument("--seq", type=positive_int, help="context length (default: the preset's)")
    t.add_argument("--accumulate", type=positive_int, metavar="K",
                   help="K micro-batches per optimizer step, each unit read once for all K (Engine.train_batch)")
    t.add_argument("--lr", type=positive_float, help="peak learning rate (default: 2e-3 for tiny, 6e-4 to 1.2e-4 "
                   "for the larger presets by size, 2e-5 for a full fine-tune with --model, 1e-3 with --lora)")
    t.add_argument("--grad-clip", type=non_negative_float, default=1.0,
                   help="global norm clip; 0 turns it off (default 1.0)")
    t.add_argument("--host-budget", type=_size, help="bytes of host memory for the store (default: derived)")
    t.add_argument("--device-budget", type=_size, help="bytes of device memory for the store (default: derived; "
                   "on a CPU-only machine the compute device is the CPU)")
    t.add_argument("--prefetch-depth", type=non_negative_int, help="units fetched ahead of use (default 2)")
    t.add_argument("--eval-every", type=positive_int, help="steps between validation losses (default: 5 per run)")
    t.add_argument("--max-memory", type=_size, metavar="SIZE", help="memory this run may use, checked with the "
                   "step's activations before it starts (default: what the machine has available)")
    t.add_argument("--log-every", type=positive_int, default=10, metavar="N",
                   help="steps per row of OUT/log.jsonl, and per line where the output is not a terminal (default 10)")
    t.add_argument("--report-to", type=_words, default=(), metavar="TRACKERS",
                   help="also log to tensorboard (OUT/tensorboard) and/or wandb (offline unless WANDB_MODE says "
                   "otherwise), comma-separated (default: OUT/log.jsonl alone)")
    t.add_argument("--eval-batches", type=positive_int, default=4,
                   help="held-out batches each validation loss averages (default 4)")
    t.add_argument("--save-every", type=positive_int, help="also checkpoint every N steps (the last step always is)")
    t.add_argument("--no-save", action="store_true", help="do not write the final checkpoint")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    t.add_argument("--tag", help="with --resume: the checkpoint to continue from (default: the latest)")
    t.add_argument("--checkpoint-activations", action=argparse.BooleanOptionalAction,
                   help="recompute blocks in backward (default: on for 24 layers and more)")
    t.add_argument("--seed", type=int_in(SEEDS), default=0,
                   help="the model's initialization, the batches drawn and the held-out split (default 0)")
    t.add_argument("--timeout", type=positive_float, metavar="SECONDS",
                   help="how long a collective waits for a stalled rank before every rank stops (default 600)")
    t.add_argument("--json", metavar="PATH", help="also write the run's summary as JSON")
    t.set_defaults(run=_train)

    e = sub.add_parser("estimate", help="per-tier bytes per rank for a model, stage and offload setting")
    which = e.add_mutually_exclusive_group(required=True)
    which.add_argument("--params", type=_count, help="parameter count, e.g. 13B (a GPT of that size)")
    which.add_argument("--model", help=f"a preset ({', '.join(PRESET_NAMES)}), a Hugging Face model directory "
                       "(sized from its config.json) or module:factory")
    e.add_argument("--lora", type=positive_int, metavar="R", help="with --model DIR: LoRA adapters of rank R on every "
                   "linear layer, the rest frozen (no gradient or optimizer state)")
    _lora_targets(e)
    e.add_argument("--world-size", type=positive_int, default=1,
                   help="data-parallel ranks the states are sharded over (default 1)")
    e.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="bf16", help="compute dtype (default bf16)")
    e.add_argument("--stage", type=int, choices=(1, 2, 3), help="one ZeRO stage (default: every stage)")
    e.add_argument("--offload-params", choices=OFFLOADS, help="one placement of the parameter shards (default: "
                   "every one the stage allows)")
    e.add_argument("--offload-optimizer", choices=OFFLOADS, help="one placement of the optimizer states (default: "
                   "every one)")
    e.add_argument("--prefetch-depth", type=non_negative_int, default=2, help="units fetched ahead of use (default 2)")
    e.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="where compute runs (default cuda); cpu: DEVICE is RAM too, and the whole prefetch window is "
                   "on it")
    e.add_argument("--sub-group-size", type=_sub_group_size, default=1 << 22,
                   help="elements per optimizer chunk (default 4M)")
    e.add_argument("--grad-clip", type=non_negative_float, default=1.0, help="0: no clipping (gradients then stream)")
    e.add_argument("--accumulate", type=positive_int, metavar="K", help="also size the activation keys a "
                   "train_batch of K micro-batches keeps (needs --batch and --seq, and a GPT shape or model directory)")
    e.add_argument("--batch", type=positive_int, help="sequences per micro-batch: sizes the step's "
                   "activations (and with --accumulate the activation keys) (default 1)")
    e.add_argument("--seq", type=positive_int, help="context length of the activations sized (default: the "
                   "model's)")
    e.add_argument("--json", metavar="PATH", help="also write the estimate as JSON")
    e.set_defaults(run=_estimate)

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
    x.set_defaults(run=_export)

    u = sub.add_parser("tune", help="sweep prefetch and I/O settings on the real model; write the fastest")
    u.add_argument("--config", required=True, help="the starting outcore.Config file (its budgets are the limits)")
    u.add_argument("--model", default="tiny", help=f"a preset ({', '.join(PRESET_NAMES)}), a Hugging Face model "
                   "directory (its weights; random token ids) or module:factory (default tiny)")
    u.add_argument("--steps", type=positive_int, default=3, help="timed steps per candidate, after one warm-up "
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
    u.add_argument("--max-rss", type=_size, help="reject candidates whose peak RSS is above this")
    u.add_argument("--timeout", type=positive_float, default=1800, help="seconds per candidate (default 1800)")
    u.add_argument("--json", metavar="PATH", help="also write every candidate's figures as JSON")
    u.set_defaults(run=_tune)
    return p


def _bench_disk(args: argparse.Namespace) -> int:
    from outcore.tools.bench_disk import bench_disk
    from outcore.tools.report import progress, table, write_json

    settings = len(args.block_size) * len(args.queue_depth) * len(args.threads) * len(args.backend)
    with progress(args.repeats * settings, "bench-disk") as bar:
        try:
            res = bench_disk(args.dir, size=args.size, block_sizes=args.block_size, queue_depths=args.queue_depth,
                             threads=args.threads, backends=args.backend, direct=args.direct,
                             repeats=args.repeats, use_fio=not args.no_fio, progress=bar)
        except ValueError as e:
            raise UsageError(str(e)) from None
    fio = res["use_fio"]
    headers = ["backend", "direct", "block", "qd", "thr", "write MB/s", "read MB/s"]
    headers += ["fio write", "fio read", "w ratio", "r ratio"] if fio else []
    rows = []
    for i, r in enumerate(res["results"]):
        w_mark = "*" if res["best_write"] == i else " "
        r_mark = "*" if res["best_read"] == i else " "
        row = [r["backend"], "yes" if r["direct_used"] else "no", human_bytes(r["block_size"]), r["queue_depth"],
               r["threads"], f"{r['write_MBps']:,.0f}{w_mark}", f"{r['read_MBps']:,.0f}{r_mark}"]
        if fio:
            row += [f"{r['fio_write_MBps']:,.0f}", f"{r['fio_read_MBps']:,.0f}",
                    f"{r['write_ratio']:.2f}", f"{r['read_ratio']:.2f}"]
        rows.append(row)
    print(f"{human_bytes(res['size'])} file in {res['directory']}, median of {res['repeats']} run(s); * = best")
    table(headers, rows)
    if fio:
        print("\nratios are medians of ours / fio run back to back (libaio, same block size and queue depth)")
        print("best per block size, ours vs fio's best (and the best paired ratio):")
        table(["block", "write MB/s", "fio", "ratio", "paired", "read MB/s", "fio", "ratio", "paired"],
              [[human_bytes(bs), f"{v['ours_write_MBps']:,.0f}", f"{v['fio_write_MBps']:,.0f}",
                f"{v['write_ratio']:.2f}", f"{v['write_ratio_paired']:.2f}", f"{v['ours_read_MBps']:,.0f}",
                f"{v['fio_read_MBps']:,.0f}", f"{v['read_ratio']:.2f}", f"{v['read_ratio_paired']:.2f}"]
               for bs, v in res["by_block_size"].items()])
    else:
        why = "--no-fio was given" if args.no_fio else "fio is not on PATH"
        print(f"\n(no fio reference figures: {why})")
    if not res["cache_dropped"]:
        print("note: could not drop the global page cache (needs root); the file itself was evicted with fadvise")
    slots = human_bytes(res["largest_host_buffers_bytes"])
    print(f"peak RSS {human_bytes(res['peak_rss_bytes'])} (largest I/O slots {slots})")
    write_json(args.json, res)
    return EXIT_OK


def _writable(path: str, flag: str, *, folder: bool) -> None:
    from outcore.tools.report import check_writable

    try:
        check_writable(path, flag, folder=folder)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _train(args: argparse.Namespace) -> int:
    from outcore.tools.report import write_json
    from outcore.tools.train import TrainOptions, train

    _writable(args.out, "--out", folder=True)
    if args.nvme_dir:
        _writable(args.nvme_dir, "--nvme-dir", folder=True)

    if args.preset and args.model:
        raise UsageError(f"--preset {args.preset} and --model {args.model} each name the model to train: give one.")
    if args.tag and not args.resume:
        raise UsageError("--tag names the checkpoint to resume from: give --resume too.")
    if args.resume:
        from outcore.runtime.checkpoint_folder import NoCheckpointError, find_checkpoint

        checkpoints = os.path.join(args.out, "checkpoints")
        try:
            find_checkpoint(checkpoints, args.tag)
        except NoCheckpointError:
            raise UsageError(f"--resume: no checkpoint in {checkpoints!r} yet; run without --resume first, or point "
                             "--out at the earlier run.") from None
        except ValueError as e:
            raise UsageError(f"--resume: {e}") from None
    opts = TrainOptions(preset=args.preset or "tiny", model=args.model, lora=args.lora,
                        merge_adapters=args.merge_adapters, lora_alpha=args.lora_alpha,
                        lora_targets=args.lora_targets, lora_init=args.lora_init, dora=args.dora,
                        config=args.config,
                        steps=args.steps, data=args.data, chat_template=args.chat_template,
                        train_on_prompt=args.train_on_prompt, packing=not args.no_packing, eval_data=args.eval_data,
                        eval_split=args.eval_split, out=args.out,
                        nvme_dir=args.nvme_dir, offload_params=args.offload_params,
                        offload_optimizer=args.offload_optimizer, dtype=args.dtype, batch=args.batch, seq=args.seq,
                        lr=args.lr, grad_clip=args.grad_clip or None, host_budget=args.host_budget,
                        device_budget=args.device_budget, prefetch_depth=args.prefetch_depth,
                        eval_every=args.eval_every, eval_batches=args.eval_batches, save_every=args.save_every,
                        save_final=not args.no_save, resume=args.resume, resume_tag=args.tag,
                        checkpoint_activations=args.checkpoint_activations, seed=args.seed,
                        collective_timeout=args.timeout, accumulate=args.accumulate, log_every=args.log_every,
                        report_to=tuple(args.report_to), max_memory=args.max_memory)
    # Under torchrun every rank runs this; rank 0 speaks and writes the summary, as DeepSpeed and
    # the Hugging Face Trainer log on the main process only. An error is said by each rank it hits.
    main_rank = int(os.environ.get("RANK", "0")) == 0
    try:
        summary = train(opts, report=(lambda line: print(line, flush=True)) if main_rank else (lambda line: None))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if main_rank:
        write_json(args.json, summary)
    stopped = summary["stopped"]
    if stopped is not None:  # a signal at a step boundary: saved, summarized, said in one line
        if main_rank:
            print(f"outcore train: stopped by {stopped['signal']} after step {stopped['after_step']} of "
                  f"{summary['steps']}; {stopped['resume']}", file=sys.stderr)
        return stopped["exit_code"]
    return EXIT_OK


def _estimate(args: argparse.Namespace) -> int:
    from outcore.hf.source import HFModel
    from outcore.tools.estimate import estimate_table, hf_dims, legal_settings, train_batch_activations
    from outcore.tools.model_source import resolve_model, source_layout, synthetic_unit_numels, unit_layout
    from outcore.tools.report import table, write_json

    layout: dict = {}
    dims: tuple[int, int, int, int] | None = None  # layers, d_model, vocab, context: for --accumulate
    try:
        if args.lora_targets is not None and args.lora is None:
            raise ValueError("--lora-targets names the modules LoRA adapts: give --lora R too.")
        if args.params:
            units, shape = synthetic_unit_numels(args.params)
            dims = (shape.layers, shape.d_model, shape.vocab, shape.seq)
            what = (f"a GPT of {human_count(sum(units))} parameters ({shape.layers} layers, d_model {shape.d_model}, "
                    f"vocab {shape.vocab})")
        elif args.lora is not None:
            if not os.path.isdir(args.model):
                raise ValueError("--lora sizes adapters of a Hugging Face model: give --model DIR.")
            hf = HFModel(args.model, args.lora, lora_targets=args.lora_targets, causal_only=False)
            units, layout = unit_layout(hf.build())
            dims = hf_dims(hf.config())
            trained = sum(n for n, f in zip(units, layout["frozen"], strict=True) if not f)
            what = (f"{args.model} + LoRA r={args.lora} ({human_count(sum(units))} parameters, "
                    f"{human_count(trained)} trained)")
        else:
            source = resolve_model(args.model, causal_only=False)
            units, layout = source_layout(source)
            if source.gpt is not None:
                dims = (source.gpt.layers, source.gpt.d_model, source.gpt.vocab, source.gpt.seq)
            elif os.path.isdir(args.model):
                dims = hf_dims(HFModel(args.model).config())
            what = f"{args.model} ({human_count(sum(units))} parameters)"
        if args.accumulate and dims is None:
            raise ValueError(f"--accumulate: the activations of {args.model!r} cannot be sized from here; give a "
                             "preset, --params or a model directory.")
    except ValueError as e:
        raise UsageError(str(e)) from None
    settings = legal_settings(args.stage, args.offload_params, args.offload_optimizer)
    if not settings:
        raise UsageError("no legal setting matches: parameter offload needs --stage 3.")
    rows = estimate_table(units, settings, world=args.world_size, dtype=args.dtype, prefetch_depth=args.prefetch_depth,
                          sub_group_size=args.sub_group_size, grad_clip=args.grad_clip or None, device=args.device,
                          **layout)
    print(f"{what}, {args.dtype}, world size {args.world_size}, {len(units)} fetch units; bytes per rank")
    table(["stage", "params", "optimizer", "device", "host", "nvme", "min device", "min host"],
          [[r["stage"], r["offload_params"], r["offload_optimizer"], human_bytes(r["device"]["total"]),
            human_bytes(r["host"]["total"]), human_bytes(r["nvme"]["total"]), human_bytes(r["device_min"]),
            human_bytes(r["host_min"])] for r in rows])
    print("device and host include the runtime's buffers (prefetch window, gathered units, gradients, "
          "optimizer pipeline);")
    print("activations are the model's and not counted. On a CPU-only machine device and host are both RAM.")
    print("'min' is the smallest budget the engine accepts; between min and the estimate it evicts more.")
    resident = {(r["stage"], r["offload_optimizer"]): r["device"]["total"] for r in rows
                if r["offload_params"] == "none"}
    no_saving = [r for r in rows if r["offload_params"] != "none" and r["device"]["total"]
                 >= resident.get((r["stage"], r["offload_optimizer"]), r["device"]["total"] + 1)]
    if no_saving:
        print(f"Parameters offloaded still pass through the device: the prefetch window ({args.prefetch_depth} units "
              "ahead), the unit running and its gradient. With")
        print(f"{len(units)} units that is the whole model, each unit padded to whole pages, so here offloading the "
              "parameters saves no device memory.")
    if any(o == "nvme" for _, _, o in settings):
        print("With the optimizer on NVMe, host holds the optimizer states of the root and of the large modules "
              "outside the blocks,")
        print("whose updates backward cannot hide: the derived host budget keeps them there.")
    step_rows = _activation_rows(args, dims)
    activations = None
    if args.accumulate and dims is not None:
        layers, d_model, vocab, context = dims
        seq = args.seq or context
        activations = train_batch_activations(layers=layers, d_model=d_model, vocab=vocab, batch=args.batch or 1,
                                              seq=seq, micro_batches=args.accumulate, dtype=args.dtype)
        print(f"train_batch of {args.accumulate} micro-batches of {args.batch or 1} x {seq}: "
              f"{human_bytes(activations)} of activation keys per rank, paged through host memory and NVMe "
              "within the budgets above")
    write_json(args.json, {"model": what, "dtype": args.dtype, "world_size": args.world_size, "units": units,
                           "rows": rows, "train_batch_activation_bytes": activations,
                           "activation_rows": step_rows})
    return EXIT_OK


def _activation_rows(args: argparse.Namespace, dims: tuple[int, int, int, int] | None) -> dict | None:
    """`--batch B --seq S`: the step's activations by part, with and without checkpointing, printed."""
    from outcore.tools.activations import Shape, activation_rows

    if dims is None or (args.batch is None and args.seq is None):
        return None
    layers, d_model, vocab, context = dims
    seq, batch = args.seq or context, args.batch or 1
    out = {}
    for checkpointed in (False, True):
        rows = activation_rows(Shape(layers, d_model, vocab), batch=batch, seq=seq, dtype=args.dtype,
                               checkpointed=checkpointed)
        out["checkpointed" if checkpointed else "plain"] = rows
        print(f"activations of one micro-batch of {batch} x {seq}, "
              f"{'with' if checkpointed else 'without'} activation checkpointing: {human_bytes(sum(rows.values()))}")
        for part, size in rows.items():
            print(f"  {part}: {human_bytes(size)}")
    print("These are on the compute device besides the budgets (on a CPU, RAM); `outcore train` checks them "
          "before its first step.")
    return out


def _export(args: argparse.Namespace) -> int:
    from outcore.tools.export import export_checkpoint
    from outcore.tools.report import write_json

    try:
        res = export_checkpoint(args.checkpoint, args.out, tag=args.tag, dtype=args.dtype, verify=not args.no_verify,
                                max_shard_size=args.max_shard_size, merge_adapters=args.merge_adapters,
                                tokenizer=args.tokenizer)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(f"wrote {res['out']}: {res['tensors']} tensors, {human_bytes(res['bytes'])}, {res['dtype']}, "
          f"step {res['step']} of {res['checkpoint']}; peak working memory one parameter "
          f"({human_bytes(res['largest_parameter_bytes'])} in fp32)")
    if res["tokenizer_from"]:
        print(f"with the tokenizer of {res['tokenizer_from']}")
    elif not res["out"].endswith(".safetensors"):
        print("without a tokenizer: the checkpoint does not say where the model came from; give --tokenizer DIR")
    write_json(args.json, res)
    return EXIT_OK


def _tune(args: argparse.Namespace) -> int:
    from outcore import runtime
    from outcore.runtime.config_text import config_format
    from outcore.tools.model_source import resolve_model
    from outcore.tools.train import scratch_nvme_dir

    _writable(args.out, "--out", folder=False)  # checked before a sweep that may take hours
    try:
        config_format(args.out)
    except ValueError as e:
        raise UsageError(f"--out: {e}") from None
    try:
        values = runtime.Config.file_values(args.config)
        scratch = scratch_nvme_dir(values)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        try:
            base = runtime.Config.from_dict(values)
            resolve_model(args.model)  # a wrong name fails here, before any candidate runs
        except ValueError as e:
            raise UsageError(str(e)) from None
        if scratch is not None:
            print(f"NVMe tier in {scratch.path} for the candidates (removed at the end; the written config names "
                  "no nvme_dir, as the given one did)", flush=True)
        return _sweep(args, base, keep_nvme_dir=scratch is None)
    finally:
        if scratch is not None:
            scratch.remove()


def _sweep(args: argparse.Namespace, base, *, keep_nvme_dir: bool) -> int:
    from outcore.runtime.config_text import write_values
    from outcore.tools.report import table, write_json
    from outcore.tools.tune import tune

    sweep = {k: v for k, v in (("prefetch_depth", args.prefetch_depth), ("block_size", args.block_size),
                               ("queue_depth", args.queue_depth), ("threads", args.threads),
                               ("nice", args.nice)) if v}

    def show(c) -> None:
        r = c.result
        if c.ok:
            print(f"  {c.label}: {r['step_seconds']:.3f} s/step, I/O wait {r['io_wait_seconds']:.3f} s, "
                  f"peak RSS {human_bytes(r['peak_rss_bytes'])}", flush=True)
        else:
            print(f"  {c.label}: failed: {r['error']}", flush=True)

    print(f"tuning {args.model} from {args.config}: {args.steps} timed steps per candidate", flush=True)
    try:
        best, tried = tune(base, args.model, steps=args.steps, batch=args.batch, seq=args.seq, sweep=sweep,
                           max_rss=args.max_rss, timeout=args.timeout, on_result=show)
    except ValueError as e:
        raise UsageError(str(e)) from None
    rows = []
    for c in sorted(tried, key=lambda c: c.result.get("step_seconds", float("inf"))):
        r, io = c.result, c.config.io
        mark = "*" if c.config is best else " "
        rows.append([c.config.prefetch_depth, human_bytes(io.block_size), io.queue_depth, io.threads, io.nice,
                     human_bytes(c.config.host_budget) if c.config.host_budget else "auto",
                     f"{r['step_seconds']:.3f}{mark}" if c.ok else "failed",
                     f"{r['io_wait_seconds']:.3f}" if c.ok else "-",
                     human_bytes(r["peak_rss_bytes"]) if c.ok else r["error"][:40]])
    table(["prefetch", "block", "qd", "threads", "nice", "host budget", "s/step", "I/O wait s", "peak RSS"], rows)
    written = best.to_dict() if keep_nvme_dir else {**best.to_dict(), "nvme_dir": None}
    write_values(args.out, written)  # as Config.to_file writes it, in the format --out names
    print(f"fastest (*) written to {args.out}; use it with `outcore train --config {args.out}`")
    write_json(args.json, {"best": written, "candidates": [
        {"label": c.label, "config": c.config.to_dict(), **c.result} for c in tried]})
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="outcore: %(message)s")
    with handle_signals():
        try:
            return _run(argv)
        except Interrupted as e:  # before the command began
            print(f"outcore: {e}", file=sys.stderr)
            return e.exit_code


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except ValueError as e:
        print(f"outcore: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if getattr(args, "json", None):  # every command's --json, checked before its work
            _writable(args.json, "--json", folder=False)
        return args.run(args)
    except Interrupted as e:
        print(f"outcore {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except UsageError as e:
        print(f"outcore: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # the reader of our output left (`outcore estimate ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not fail again
        return EXIT_RUNTIME
    except Exception as e:  # noqa: BLE001 - a runtime failure: its cause, not a traceback
        print(f"outcore {args.command}: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_RUNTIME


if __name__ == "__main__":
    sys.exit(main())
