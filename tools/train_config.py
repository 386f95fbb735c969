"""The run's `Config` for `outcore train`: the config file's values, overridden by the flags, the
rest chosen for this machine (bf16 where it is native, the least offloading that fits within
--max-memory, a scratch NVMe folder where one is needed and none named), each choice said.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

import torch

from outcore import runtime
from outcore.offload.owned_dir import OwnedDir
from outcore.tools.activations import paged_inputs_room
from outcore.tools.estimate import estimate, quantized_stored
from outcore.tools.memory_bound import MemoryBound, choose_offload
from outcore.tools.train_options import TrainOptions


def native_bf16(device: torch.device) -> bool:
    """Whether this device computes bf16 in hardware (else it is emulated, slower than fp32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def build_config(opts: TrainOptions, units: list[int], device: torch.device, activations: Callable[[str], int],
                 layout: dict | None = None) -> tuple[runtime.Config, list[str], OwnedDir | None, dict]:
    """The run's Config: the file's, overridden by flags, the rest chosen for this machine, within
    --max-memory (tools/memory_bound.py; `activations`: a step's bytes in a compute dtype; `layout`:
    what the run keeps of each unit, as `estimate` takes it). Also returns what was chosen (to
    print), the NVMe folder created for the run, if any, and the memory arithmetic."""
    notes = []
    values = runtime.Config.file_values(opts.config) if opts.config else {}
    values.update({k: v for k, v in {
        "nvme_dir": opts.nvme_dir, "dtype": opts.dtype, "state_dtype": opts.state_dtype,
        "host_budget": opts.host_budget,
        "device_budget": opts.device_budget, "prefetch_depth": opts.prefetch_depth,
        "offload_params": opts.offload_params, "offload_optimizer": opts.offload_optimizer,
        "offload_activations": opts.offload_activations,
        "collective_timeout": opts.collective_timeout, "quantize": opts.quantize,
        "quantize_double": opts.quantize_double or None}.items() if v is not None})
    if not opts.config:
        values["grad_clip"] = opts.grad_clip
        if opts.dtype is None:
            values["dtype"] = "bf16" if native_bf16(device) else "fp32"
            notes.append(f"dtype {values['dtype']} ({'native' if values['dtype'] == 'bf16' else 'no native'} "
                         f"bf16 on {device.type})")
        if opts.offload_params is None and opts.offload_optimizer is None:
            defaults = runtime.Config()
            depth = values.get("prefetch_depth", defaults.prefetch_depth)
            kept = kept_layout(units, layout, values.get("quantize"), bool(values.get("quantize_double")))
            params, opt, why = choose_offload(units, values["dtype"], defaults.stage, values["grad_clip"], depth,
                                              MemoryBound.now(opts.max_memory, activations(values["dtype"])), kept,
                                              values.get("state_dtype", defaults.state_dtype))
            values.update(offload_params=params, offload_optimizer=opt)
            notes.append(f"offload params={params} optimizer={opt}: {why}")
    values.update(opts.overrides)
    owned = scratch_nvme_dir(values)
    if owned is not None:
        notes.append(f"NVMe tier in {owned.path} (removed at the end; --nvme-dir to choose)")
    try:
        config = runtime.Config.from_dict(values)
        if opts.accumulate and config.grad_accumulation != 1:
            raise ValueError(f"--accumulate {opts.accumulate} runs its micro-batches through one train_batch; the "
                             f"config's grad_accumulation={config.grad_accumulation} must then be 1.")
        bound = MemoryBound.now(opts.max_memory, activations(config.dtype))
        plan = estimate(units, dtype=config.dtype, state_dtype=config.state_dtype, stage=config.stage,
                        offload_params=config.offload_params, offload_optimizer=config.offload_optimizer,
                        prefetch_depth=config.prefetch_depth, grad_clip=config.grad_clip, device=device.type,
                        **kept_layout(units, layout, config.quantize, config.quantize_double))
        device_budget, host_budget, lowered = bound.budgets(plan, config.device_budget, config.host_budget,
                                                            device.type == "cpu", config.dtype)
        if lowered is not None:
            config = replace(config, host_budget=host_budget)
            notes.append(lowered)
        room = paged_inputs_room(config.offload_activations, opts.max_memory)
        if opts.max_memory is not None and opts.host_budget is None and room:
            # The engine would size this room from the machine's free memory: sized from the bound
            # here, and counted with the activations (tools/sequence_pieces.py). Optimizer states
            # the host budget keeps may take some of it; the inputs then page on to NVMe sooner.
            config = replace(config, host_budget=host_budget + room)
        if config.dtype == "fp16" and device.type == "cpu":
            notes.append("dtype fp16 on a CPU: it has no fp16 arithmetic, so each operation is emulated (slower than "
                         "fp32) under loss scaling; --dtype bf16 or fp32 is what a CPU computes in")
        return config, notes, owned, bound.as_json(device_budget if device.type == "cpu" else 0, host_budget)
    except ValueError:
        if owned is not None:
            owned.remove()
        raise


def kept_layout(units: list[int], layout: dict | None, quantize: str | None, double: bool) -> dict:
    """`layout` with a quantized base's stored bytes (`Config.quantize`, or how a pre-quantized
    directory stores it: `stored_as`), as the estimate counts them."""
    if not layout:
        return {}
    layout = dict(layout)
    stored_as = layout.pop("stored_as", None)
    if quantize is None and stored_as is not None:
        quantize, double = stored_as
    if quantize is None:
        return layout
    return {**layout, "stored": quantized_stored(units, layout, int(os.environ.get("WORLD_SIZE", "1")), quantize,
                                                 double)}


def scratch_nvme_dir(values: dict) -> OwnedDir | None:
    """Config values that put something on NVMe but name no nvme_dir get a scratch folder under the
    working directory (set as their nvme_dir); the caller removes it when the run ends."""
    offloads = (values.get("offload_params"), values.get("offload_optimizer"), values.get("offload_activations"))
    if values.get("nvme_dir") is not None or "nvme" not in offloads:
        return None
    owned = OwnedDir(".outcore-nvme-", os.getcwd())  # a killed run's one is reclaimed here
    values["nvme_dir"] = owned.path
    return owned
