"""The `outcore` command line: parse (the flags are in tools/cli_flags.py), call an importable
function, print. No logic lives here."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from outcore.runtime.sizes import human_bytes
from outcore.tools.cli_flags import EXIT_USAGE, build_parser, given_flags
from outcore.tools.interrupts import Interrupted, handle_signals

EXIT_OK, EXIT_RUNTIME = 0, 1


class UsageError(Exception):
    """A user mistake: printed as one line, exit status 2."""


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
    from outcore.tools.cli_flags import command_actions
    from outcore.tools.report import write_json
    from outcore.tools.run_record import recorded, resumed
    from outcore.tools.train import train
    from outcore.tools.train_options import options_from_args

    _writable(args.out, "--out", folder=True)
    for name in ("tag", "data_changed_ok"):
        if getattr(args, name) and not args.resume:
            raise UsageError(f"--{name.replace('_', '-')} is for a resume: give --resume too.")
    if args.resume:
        from outcore.runtime.checkpoint.folder import NoCheckpointError, find_checkpoint

        checkpoints = os.path.join(args.out, "checkpoints")
        try:
            find_checkpoint(checkpoints, args.tag)
            saved = recorded(args.out, command_actions("train"))
            if saved is not None:  # the run's own arguments, with what this command may change
                values, changes = resumed(saved, vars(args), getattr(args, "given", set(vars(args))),
                                          world=int(os.environ.get("WORLD_SIZE", "1")))
                args = argparse.Namespace(**values)
                for change in changes:
                    _console(f"outcore train: resumed with {change}")
        except NoCheckpointError:
            raise UsageError(f"--resume: no checkpoint in {checkpoints!r} yet; run without --resume first, or point "
                             "--out at the earlier run.") from None
        except ValueError as e:
            raise UsageError(str(e) if str(e).startswith("--resume") else f"--resume: {e}") from None
    if args.nvme_dir:
        _writable(args.nvme_dir, "--nvme-dir", folder=True)
    if args.preset and args.model:
        raise UsageError(f"--preset {args.preset} and --model {args.model} each name the model to train: give one.")
    opts = options_from_args(args)
    # Under torchrun every rank runs this; rank 0 speaks and writes the summary, as DeepSpeed and
    # the Hugging Face Trainer log on the main process only. An error is said by each rank it hits.
    main_rank = int(os.environ.get("RANK", "0")) == 0
    try:
        summary = train(opts, report=_console if main_rank else (lambda line: None))
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


def _console(line: str) -> None:
    """A line of the run's on stdout. A reader that left (`outcore train ... | head -1`) does not stop
    the run: it goes on, said once on stderr, its rows in OUT/log.jsonl and its checkpoints as asked."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # later lines, and the exit's flush, go nowhere
        try:
            print("outcore train: stdout was closed; the run goes on, its progress in OUT/log.jsonl", file=sys.stderr,
                  flush=True)
        except OSError:
            pass


def _estimate(args: argparse.Namespace) -> int:
    from outcore.tools.estimate import estimate_table, legal_settings
    from outcore.tools.estimate_model import sized_model
    from outcore.tools.estimate_report import (
        activation_rows_printed,
        estimate_json,
        generation_report,
        max_seq_lines,
        predicted_step,
        print_table,
        step_activations,
        train_batch_printed,
    )
    from outcore.tools.estimate_verdict import Machine, verdict, verdict_lines
    from outcore.tools.report import write_json

    if args.device is None:  # where this machine computes
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:  # as `outcore train` picks it
        import torch

        from outcore.tools.train_config import native_bf16

        native = native_bf16(torch.device(args.device)) if args.device == "cpu" or torch.cuda.is_available() else True
        args.dtype = "bf16" if native else "fp32"
    try:
        model = sized_model(args)
        if args.accumulate and model.dims is None:
            raise ValueError(f"--accumulate: the activations of {args.model!r} cannot be sized from here; give a "
                             "preset, --params or a model directory.")
    except ValueError as e:
        raise UsageError(str(e)) from None
    settings = legal_settings(args.stage, args.offload_params, args.offload_optimizer)
    if not settings:
        raise UsageError("no legal setting matches: parameter offload needs --stage 3.")
    rows = estimate_table(model.units, settings, world=args.world_size, dtype=args.dtype, state_dtype=args.state_dtype,
                          prefetch_depth=args.prefetch_depth, sub_group_size=args.sub_group_size,
                          grad_clip=args.grad_clip or None, device=args.device, **model.layout)
    print_table(args, model, rows, settings)
    machine = Machine.detect(args.nvme_dir)
    verdict_ = verdict(model.units, model.layout, machine, dtype=args.dtype, state_dtype=args.state_dtype,
                       world=args.world_size, prefetch_depth=args.prefetch_depth, sub_group_size=args.sub_group_size,
                       grad_clip=args.grad_clip or None, device=args.device,
                       activations=step_activations(args, model))
    try:
        step_rows = activation_rows_printed(args, model.dims)
        prediction = predicted_step(args, model, verdict_)
    except ValueError as e:
        raise UsageError(str(e)) from None
    activations = train_batch_printed(args, model)
    for line in verdict_lines(verdict_, machine):
        print(line)
    summary = estimate_json(args, model, rows, activations, step_rows, prediction, verdict_)
    try:
        if args.max_seq:
            summary["max_seq"], said = max_seq_lines(args, model, verdict_, machine)
            print("\n".join(said))
        if args.generate:
            summary["generation"], said = generation_report(args, model, verdict_, machine)
            print("\n".join(said))
    except ValueError as e:
        raise UsageError(str(e)) from None
    write_json(args.json, summary)
    return EXIT_OK


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
    from outcore.tools.train_config import scratch_nvme_dir

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
    from outcore.tools.sweep_pruning import SweepPruner
    from outcore.tools.tune import tune

    sweep = {k: v for k, v in (("prefetch_depth", args.prefetch_depth), ("block_size", args.block_size),
                               ("queue_depth", args.queue_depth), ("threads", args.threads),
                               ("nice", args.nice)) if v}

    def show(c) -> None:  # the round just measured (the table below gives each candidate's medians)
        r = c.samples[-1]
        if "error" not in r:
            print(f"  {c.label}: {r['step_seconds']:.3f} s/step, I/O wait {r['io_wait_seconds']:.3f} s, "
                  f"peak RSS {human_bytes(r['peak_rss_bytes'])}", flush=True)
        else:
            print(f"  {c.label}: failed: {r['error']}", flush=True)

    print(f"tuning {args.model} from {args.config}: {args.steps} timed steps per candidate, candidates compared "
          f"over {args.rounds} interleaved rounds", flush=True)
    try:
        pruner = None
        if not args.no_prune:
            print("measuring this machine's rates to predict which candidates can matter (--no-prune skips this)",
                  flush=True)
            pruner = SweepPruner.measured(base, args.model, batch=args.batch, seq=args.seq)
        tuned = tune(base, args.model, steps=args.steps, batch=args.batch, seq=args.seq, sweep=sweep,
                     max_rss=args.max_rss, timeout=args.timeout, rounds=args.rounds, on_result=show, pruner=pruner)
    except ValueError as e:
        raise UsageError(str(e)) from None
    best, tried, confirmation = tuned.best, tuned.candidates, tuned.confirmation
    for why in tuned.pruned:
        print(f"not run, by the prediction: {why}")
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
    if confirmation is not None:
        print(f"the winner against the config as given, {args.rounds} more interleaved rounds: "
              f"{', '.join(f'{t:.3f}' for t in confirmation.winner)} against "
              f"{', '.join(f'{t:.3f}' for t in confirmation.given)} s/step; medians {confirmation.ratio:.3f}x, "
              f"the given config's own spread {100 * confirmation.spread:.1f}%")
    written = None
    if best is None:
        print("nothing beat the config as given beyond its own spread: no config written; keep using "
              f"{args.config}")
    else:
        written = best.to_dict() if keep_nvme_dir else {**best.to_dict(), "nvme_dir": None}
        write_values(args.out, written)  # as Config.to_file writes it, in the format --out names
        print(f"fastest (*) written to {args.out}; use it with `outcore train --config {args.out}`")
    write_json(args.json, {"best": written, "confirmation": confirmation.as_dict() if confirmation else None,
                           "pruned": tuned.pruned,
                           "candidates": [{"label": c.label, "config": c.config.to_dict(), **c.result,
                                           "samples": c.samples} for c in tried]})
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="outcore: %(message)s")
    # bitsandbytes (the qlora extra, imported by peft) warns at import, on CPUs with AVX512-BF16, that an
    # optional inference kernel from a hub is not loaded: nothing outcore uses, and not outcore's to say.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
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
        if args.command == "train":  # which flags this command names itself: a resume keeps the run's others
            args.given = given_flags(sys.argv[1:] if argv is None else argv)
        return COMMANDS[args.command](args)
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
        from outcore.tools.memory_bound import address_space_hint

        hint = address_space_hint(e)
        print(f"outcore {args.command}: failed: {type(e).__name__}: {e}" + (f"; {hint}." if hint else ""),
              file=sys.stderr)
        return EXIT_RUNTIME


COMMANDS = {"bench-disk": _bench_disk, "train": _train, "estimate": _estimate, "export": _export, "tune": _tune}


if __name__ == "__main__":
    sys.exit(main())
