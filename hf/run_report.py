"""The two lines the Trainer integration says of a run, on the main process: at the start of
`train()`, where the parameters and optimizer states rest and the budgets; at the end, the bytes in
each tier, the bytes read and written a step and the peak RSS. The swap file is gone at exit, so
these lines are a user's record that anything was offloaded.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

from torch import nn

from outcore.runtime.engine import Engine
from outcore.runtime.sizes import human_bytes

_WHERE = {"none": "on the compute device", "cpu": "in host memory", "nvme": "on NVMe"}


def start_line(engine: Engine) -> str:
    c, s = engine.config, engine.stats()
    params = _WHERE[c.offload_params] if c.stage == 3 else "whole on the compute device (stage < 3)"
    budgets = f"budgets {human_bytes(s['device']['budget'])} device, {human_bytes(s['host']['budget'])} host"
    swap = f", swap files in {c.nvme_dir}" if "nvme" in (c.offload_params, c.offload_optimizer) else ""
    quantized = f", the frozen base {c.quantize}" if c.quantize else ""
    return (f"outcore: ZeRO-{c.stage}, {c.dtype}; parameters {params}{quantized}, optimizer states "
            f"{_WHERE[c.offload_optimizer]}; {budgets}{swap}")


def end_line(engine: Engine, steps: int, at_start: dict[str, Any]) -> str:
    s = engine.stats()
    per = max(1, steps)
    read = (s["bytes_read"] - at_start["bytes_read"]) / per
    written = (s["bytes_written"] - at_start["bytes_written"]) / per
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return (f"outcore: {steps} steps; in the tiers {human_bytes(s['device']['resident'])} device, "
            f"{human_bytes(s['host']['resident'])} host, {human_bytes(s['nvme']['bytes'])} NVMe; "
            f"{human_bytes(read)} read and {human_bytes(written)} written a step; peak RSS {human_bytes(peak)}")


def dropout_note(model: nn.Module) -> str | None:
    """Where the model draws dropout masks, the sentence that says the losses differ from the plain
    trainer's; None without dropout."""
    rates = {m.p for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0}
    attention = getattr(getattr(model, "config", None), "attention_dropout", 0.0)
    if isinstance(attention, float) and attention > 0:  # drawn inside the attention function, not a module
        rates.add(attention)
    if not rates:
        return None
    return (f"outcore: the model draws dropout masks (p={', '.join(f'{r:g}' for r in sorted(rates))}) unit by unit, so "
            "its losses follow the plain trainer's in distribution, not bit for bit (set the dropout to 0 to compare "
            "them exactly)")
