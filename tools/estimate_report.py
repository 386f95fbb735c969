"""What `outcore estimate` prints: its table of bytes per tier, the step predicted (`--predict`,
tools/step_estimate.py) and the activations of one micro-batch (`--batch`, `--seq`); the verdict
is tools/estimate_verdict.py's. Bad flags are a ValueError, which the command line reports as a
usage error."""

from __future__ import annotations

import argparse
import contextlib
import json

import psutil

from outcore.runtime.memory_plan import plan_memory, unit_shapes
from outcore.runtime.policy import StatePolicy
from outcore.runtime.sizes import human_bytes
from outcore.tools import machine_rates
from outcore.tools import step_estimate as se
from outcore.tools.activations import Shape, activation_rows, chosen_by_train
from outcore.tools.estimate_model import SizedModel
from outcore.tools.estimate_verdict import Machine, Verdict, longest_context, room_beside_budgets
from outcore.tools.generation_memory import generation_lines
from outcore.tools.report import table


def print_table(args: argparse.Namespace, model: SizedModel, rows: list[dict],
                settings: list[tuple[int, str, str]]) -> None:
    """The bytes per tier of each setting, and what to read them with."""
    states = ", optimizer states in bf16" if args.state_dtype == "bf16" else ""
    print(f"{model.what}, {args.dtype}{states}, world size {args.world_size}, {len(model.units)} fetch units; "
          "bytes per rank")
    table(["stage", "params", "optimizer", "device", "host", "nvme", "min device", "min host"],
          [[r["stage"], r["offload_params"], r["offload_optimizer"], human_bytes(r["device"]["total"]),
            human_bytes(r["host"]["total"]), human_bytes(r["nvme"]["total"]), human_bytes(r["device_min"]),
            human_bytes(r["host_min"])] for r in rows])
    print("device and host include the runtime's buffers (prefetch window, gathered units, gradients, "
          "optimizer pipeline);")
    print("activations are the model's and not counted. On a CPU-only machine device and host are both RAM.")
    print("'min' is the smallest budget the engine accepts; between min and the estimate it evicts more. The "
          "verdict below gives the budgets a run derives.")
    resident = {(r["stage"], r["offload_optimizer"]): r["device"]["total"] for r in rows
                if r["offload_params"] == "none"}
    no_saving = [r for r in rows if r["offload_params"] != "none" and r["device"]["total"]
                 >= resident.get((r["stage"], r["offload_optimizer"]), r["device"]["total"] + 1)]
    if no_saving:
        print(f"Parameters offloaded still pass through the device: the prefetch window ({args.prefetch_depth} units "
              "ahead), the unit running and its gradient. With")
        print(f"{len(model.units)} units that is the whole model, each unit padded to whole pages, so here offloading "
              "the parameters saves no device memory.")
    if any(o == "nvme" for _, _, o in settings):
        print("With the optimizer on NVMe, host holds the optimizer states of the root and of the large modules "
              "outside the blocks,")
        print("whose updates backward cannot hide: the derived host budget keeps them there.")


def step_activations(args: argparse.Namespace, model: SizedModel) -> int:
    """A step's activations at --batch and --seq (1 and the model's context where not given), with
    activation checkpointing where `outcore train` turns it on (a model directory, or 24 layers and
    more); 0 where the model's shape is unknown."""
    if model.dims is None:
        return 0
    layers, d_model, vocab, context = model.dims
    checkpointed = args.checkpoint_activations or model.hf or layers >= 24
    shape = Shape(layers, d_model, vocab)
    how = chosen_by_train(shape, args.max_memory) if model.hf else {}  # (its loss chunks and tiles)
    return sum(activation_rows(shape, batch=args.batch or 1, seq=args.seq or context, dtype=args.dtype,
                               checkpointed=checkpointed, **how).values())


def predicted_step(args: argparse.Namespace, model: SizedModel, recommended: Verdict) -> dict | None:
    """`--predict`: the step's time split, its bound, tokens/s, MFU and the accumulation at which
    compute bounds it (tools/step_estimate.py), printed; for the setting the flags give, else the
    one the verdict recommends, at its budgets where none are given."""
    if not args.predict:
        return None
    units, layout, dims = model.units, model.layout, model.dims
    given = (args.stage, args.offload_params, args.offload_optimizer)
    if given == (None, None, None):
        stage, offload_params, offload_optimizer = (recommended.stage, recommended.offload_params,
                                                    recommended.offload_optimizer)
        print(f"predicting the recommended setting: ZeRO-{stage}, parameters {offload_params}, optimizer states "
              f"{offload_optimizer}")
    elif None in given:
        raise ValueError("--predict predicts one setting: give all of --stage, --offload-params and "
                         "--offload-optimizer, or none for the one the verdict recommends.")
    else:
        stage, offload_params, offload_optimizer = args.stage, args.offload_params, args.offload_optimizer
    if args.batch is None or (args.seq is None and dims is None):
        raise ValueError("--predict needs --batch, and --seq where the model's context is not known.")
    seq, k = args.seq or (dims[3] if dims else 1), args.accumulate or 1
    policy = StatePolicy(world=args.world_size, stage=stage, offload_params=offload_params,
                         offload_optimizer=offload_optimizer, dtype=args.dtype, device_type=args.device,
                         prefetch_depth=args.prefetch_depth, sub_group_size=args.sub_group_size,
                         clipping=bool(args.grad_clip), grad_accumulation=1 if args.vertical else k,
                         state_dtype=args.state_dtype)
    frozen = layout.get("frozen") or [False] * len(units)
    shapes = unit_shapes(units, policy, frozen=frozen, roots=layout.get("roots"), modules=layout.get("modules"),
                         outer=layout.get("outer"))
    plan = plan_memory(shapes, policy, frozen_in_files=bool(layout.get("frozen_in_files")))
    device_budget, host_budget = plan.budgets(args.device_budget, args.host_budget, psutil.virtual_memory().available)
    checkpointing = bool(args.checkpoint_activations or model.hf or (dims and dims[0] >= 24))  # as train defaults
    shape = se.shape_of(units, frozen, plan, policy, tokens=args.batch * seq, device_budget=device_budget,
                        host_budget=host_budget, checkpointing=checkpointing, vertical=args.vertical,
                        in_place_share=se.in_place_share(units, layout))
    flops = args.flops or machine_rates.measure_flops(args.device, args.dtype, tokens=args.batch * seq,
                                                      d_model=dims[1] if dims else 2048)
    frozen_share = sum(frozen) / max(1, len(units))
    micro_batch = None
    if dims is not None and not args.flops:  # the model's own shape, in plain PyTorch
        micro_batch = machine_rates.measure_compute(args.device, args.dtype, layers=dims[0], d_model=dims[1],
                                                    vocab=dims[2], seq=seq, batch=args.batch,
                                                    checkpointing=checkpointing, frozen=frozen_share > 0.5)
    overhead, update_rate = ((args.overhead, None) if args.overhead is not None else
                             machine_rates.measure_engine_costs(len(units), policy, args.nvme_dir,
                                                                frozen_share=frozen_share))
    if args.disk:
        with open(args.disk) as f:
            read, write = machine_rates.disk_rates(json.load(f))
    else:
        print(f"measuring the disk in {args.nvme_dir!r} (give --disk bench.json to skip) ...", flush=True)
        read, write = machine_rates.measure_disk(args.nvme_dir)
    rates = se.Rates(disk_read=read, disk_write=write, flops=flops,
                     adam=args.adam_rate or update_rate or machine_rates.measure_adam(),
                     host_device=None if args.device == "cpu" else (args.host_device_rate or 25e9),
                     peak_flops=args.peak_flops or flops,
                     checksum=(machine_rates.measure_checksum() if args.device == "cpu" and not args.no_checksum
                               else None),
                     overhead=overhead, micro_batch=micro_batch,
                     in_place_read=(machine_rates.measure_in_place_read(args.nvme_dir)
                                    if args.device == "cpu" and shape.in_place_share and shape.params_on_nvme
                                    else None))
    step = se.predict_step(shape, rates, k)
    least = se.compute_bound_accumulation(shape, rates)
    mfu = step.mfu(rates.peak_flops)
    print(f"predicted step, {k} micro-batch(es) of {args.batch} x {seq}, budgets {human_bytes(device_budget)} "
          f"device and {human_bytes(host_budget)} host: {step.step:.3f} s, bound by {step.bound}")
    how = ("as a model of its shape takes them, measured" if micro_batch is not None
           else f"at {flops / 1e9:,.1f} GFLOP/s")
    print(f"  compute {step.compute:.3f} s ({step.flops / 1e9:,.1f} GFLOP {how}), "
          f"NVMe {step.nvme:.3f} s ({human_bytes(step.nvme_read)} read at {read / 1e9:.2f} GB/s, "
          f"{human_bytes(step.nvme_written)} written at {write / 1e9:.2f} GB/s), host-device {step.host_device:.3f} s, "
          f"updates {step.optimizer:.3f} s ({rates.adam / 1e6:,.0f}M parameters/s through the engine's update path"
          + (f"; with the checksums at {rates.checksum / 1e9:.1f} GB/s" if rates.checksum else "")
          + f"), fixed {step.overhead:.3f} s (Python, hooks, I/O requests: a step of a model as deep, measured)")
    shown = mfu is not None and mfu <= 1
    print(f"  {step.tokens_per_s:,.0f} tokens/s" + (f", MFU {100 * mfu:.1f}%" if shown and mfu is not None else "")
          + (" (MFU not shown: --peak-flops is below the rate measured)" if mfu is not None and mfu > 1 else ""))
    if args.eval_every:
        per_step = args.eval_batches * (step.compute / 3 + step.overhead / 2) / args.eval_every
        print(f"  with {args.eval_batches} held-out batches every {args.eval_every} steps (outcore train's "
              f"evaluation): about {per_step:.3f} s more a step on average")
    print("  compute bounds the step from --accumulate " + (str(least) if least else
          f"(none up to {se.MAX_ACCUMULATION}: bytes that grow with every micro-step; try --vertical)"))
    return {**step.as_dict(rates.peak_flops), "compute_bound_accumulation": least,
            "rates": {"disk_read": read, "disk_write": write, "flops": flops, "adam": rates.adam,
                      "host_device": rates.host_device}}


def activation_rows_printed(args: argparse.Namespace, dims: tuple[int, int, int, int] | None) -> dict | None:
    """`--batch B --seq S`: the step's activations by part, with and without checkpointing, printed."""
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


def train_batch_printed(args: argparse.Namespace, model: SizedModel) -> int | None:
    """With --accumulate: the activation keys a `train_batch` of that many micro-batches pages,
    printed; their bytes, or None without it."""
    from outcore.tools.estimate import train_batch_activations

    if not args.accumulate or model.dims is None:
        return None
    layers, d_model, vocab, context = model.dims
    seq = args.seq or context
    activations = train_batch_activations(layers=layers, d_model=d_model, vocab=vocab, batch=args.batch or 1,
                                          seq=seq, micro_batches=args.accumulate, dtype=args.dtype)
    print(f"train_batch of {args.accumulate} micro-batches of {args.batch or 1} x {seq}: "
          f"{human_bytes(activations)} of activation keys per rank, paged through host memory and NVMe "
          "within the budgets above")
    return activations


def estimate_json(args: argparse.Namespace, model: SizedModel, rows: list[dict], activations: int | None,
                  step_rows: dict | None, prediction: dict | None, verdict: Verdict) -> dict:
    """What `--json` writes: the table's rows, the activations, the prediction and the verdict."""
    return {"model": model.what, "device": args.device, "dtype": args.dtype, "state_dtype": args.state_dtype,
            "world_size": args.world_size, "units": model.units,
            "rows": rows, "train_batch_activation_bytes": activations,
            "activation_rows": step_rows, "prediction": prediction,
            "verdict": {"fits": verdict.fits, "flags": verdict.flags(), "short": list(verdict.short),
                        "device_budget": verdict.device_budget, "host_budget": verdict.host_budget,
                        "derived_budgets": verdict.derived,
                        "offload_params": verdict.offload_params, "offload_optimizer": verdict.offload_optimizer}}


def max_seq_lines(args: argparse.Namespace, model: SizedModel, recommended: Verdict, machine: Machine
                  ) -> tuple[int, list[str]]:
    """`--max-seq`: the longest context that fits beside the recommended budgets, and its lines."""
    if model.dims is None:
        raise ValueError(f"--max-seq: the activations of {args.model!r} cannot be sized from here; give a preset, "
                         "--params or a model directory.")
    layers, d_model, vocab, _ = model.dims
    if model.hf:  # this process, which the room is counted beside, as `train --model`'s holds it
        with contextlib.suppress(ImportError):
            import datasets  # noqa: F401
            import peft  # noqa: F401
    return longest_context(recommended, machine, Shape(layers, d_model, vocab), batch=args.batch or 1,
                           dtype=args.dtype, checkpointed=args.checkpoint_activations or model.hf or layers >= 24,
                           device=args.device, max_memory=args.max_memory, pieces=model.hf)


def generation_report(args: argparse.Namespace, model: SizedModel, recommended: Verdict, machine: Machine
                      ) -> tuple[dict[str, int], list[str]]:
    """`--generate TOKENS`: a sequence's KV cache, and the largest generation batch that fits beside
    the recommended budgets."""
    if model.dims is None or model.kv_width is None:
        raise ValueError(f"--generate: the KV cache of {args.model!r} cannot be sized from here; give a preset, "
                         "--params or a model directory.")
    _, room, where = room_beside_budgets(recommended, machine, args.device, args.max_memory)
    return generation_lines(layers=model.dims[0], width=model.kv_width, tokens=args.generate, dtype=args.dtype,
                            room=room, where=where)
