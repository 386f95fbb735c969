"""What `outcore estimate` prints beyond its table of bytes: the step predicted (`--predict`,
tools/step_estimate.py) and the activations of one micro-batch (`--batch`, `--seq`). Bad flags
are a ValueError, which the command line reports as a usage error."""

from __future__ import annotations

import argparse
import json

import psutil

from outcore.runtime.memory_plan import plan_memory, unit_shapes
from outcore.runtime.policy import StatePolicy
from outcore.runtime.sizes import human_bytes
from outcore.tools import step_estimate as se
from outcore.tools.activations import Shape, activation_rows


def predicted_step(args: argparse.Namespace, units: list[int], layout: dict,
                   dims: tuple[int, int, int, int] | None) -> dict | None:
    """`--predict`: the step's time split, its bound, tokens/s, MFU and the accumulation at which
    compute bounds it (tools/step_estimate.py), printed."""
    if not args.predict:
        return None
    if None in (args.stage, args.offload_params, args.offload_optimizer):
        raise ValueError("--predict predicts one setting: give --stage, --offload-params and --offload-optimizer.")
    if args.batch is None or (args.seq is None and dims is None):
        raise ValueError("--predict needs --batch, and --seq where the model's context is not known.")
    seq, k = args.seq or (dims[3] if dims else 1), args.accumulate or 1
    policy = StatePolicy(world=args.world_size, stage=args.stage, offload_params=args.offload_params,
                         offload_optimizer=args.offload_optimizer, dtype=args.dtype, device_type=args.device,
                         prefetch_depth=args.prefetch_depth, sub_group_size=args.sub_group_size,
                         clipping=bool(args.grad_clip), grad_accumulation=1 if args.vertical else k,
                         state_dtype=args.state_dtype)
    frozen = layout.get("frozen") or [False] * len(units)
    shapes = unit_shapes(units, policy, frozen=frozen, roots=layout.get("roots"), modules=layout.get("modules"),
                         outer=layout.get("outer"))
    plan = plan_memory(shapes, policy, frozen_in_files=bool(layout.get("frozen_in_files")))
    device_budget, host_budget = plan.budgets(args.device_budget, args.host_budget, psutil.virtual_memory().available)
    shape = se.shape_of(units, frozen, plan, policy, tokens=args.batch * seq, device_budget=device_budget,
                        host_budget=host_budget, checkpointing=args.checkpoint_activations, vertical=args.vertical)
    flops = args.flops or se.measure_flops(args.device, args.dtype, tokens=args.batch * seq,
                                           d_model=dims[1] if dims else 2048)
    if args.disk:
        with open(args.disk) as f:
            read, write = se.disk_rates(json.load(f))
    else:
        print(f"measuring the disk in {args.nvme_dir!r} (give --disk bench.json to skip) ...", flush=True)
        read, write = se.measure_disk(args.nvme_dir)
    rates = se.Rates(disk_read=read, disk_write=write, flops=flops, adam=args.adam_rate or se.measure_adam(),
                     host_device=None if args.device == "cpu" else (args.host_device_rate or 25e9),
                     peak_flops=args.peak_flops or flops,
                     checksum=se.measure_checksum() if args.device == "cpu" and not args.no_checksum else None)
    step = se.predict_step(shape, rates, k)
    least = se.compute_bound_accumulation(shape, rates)
    mfu = step.mfu(rates.peak_flops)
    print(f"predicted step, {k} micro-batch(es) of {args.batch} x {seq}, budgets {human_bytes(device_budget)} "
          f"device and {human_bytes(host_budget)} host: {step.step:.3f} s, bound by {step.bound}")
    print(f"  compute {step.compute:.3f} s ({step.flops / 1e9:,.1f} GFLOP at {flops / 1e9:,.1f} GFLOP/s), "
          f"NVMe {step.nvme:.3f} s ({human_bytes(step.nvme_read)} read at {read / 1e9:.2f} GB/s, "
          f"{human_bytes(step.nvme_written)} written at {write / 1e9:.2f} GB/s), host-device {step.host_device:.3f} s, "
          f"optimizer {step.optimizer:.3f} s ({rates.adam / 1e6:,.0f}M parameters/s"
          + (f"; with the checksums at {rates.checksum / 1e9:.1f} GB/s" if rates.checksum else "") + ")")
    print(f"  {step.tokens_per_s:,.0f} tokens/s" + (f", MFU {100 * mfu:.1f}%" if mfu is not None else ""))
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
