"""The ranges of AdamW's hyper-parameters, checked wherever they come in: `AdamW(...)`,
`Config(optimizer=...)` and `engine.lr`. Without torch, so that reading a config imports none."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from outcore.offload.typed_fields import quoted


def _finite(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_lr(value: Any, where: str) -> float:
    """`value` as a learning rate (a finite number >= 0; 0 is a frozen step), or a ValueError naming `where`."""
    if not (_finite(value) and value >= 0):
        raise ValueError(f"{where}={quoted(value)}: a learning rate must be a finite number >= 0.")
    return float(value)


def check_hyperparameters(hp: Mapping[str, Any], where: str) -> None:
    """AdamW's numbers in the ranges torch.optim.AdamW accepts, and finite; otherwise one ValueError
    naming `where.key`. Keys absent from `hp` take their defaults and are not checked."""
    if "lr" in hp:
        check_lr(hp["lr"], f"{where}.lr")
    for key in ("eps", "weight_decay"):
        if key in hp and not (_finite(hp[key]) and hp[key] >= 0):
            raise ValueError(f"{where}.{key}={quoted(hp[key])}: must be a finite number >= 0.")
    betas = hp.get("betas", (0.9, 0.999))
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_finite(b) and 0 <= b < 1 for b in betas)):
        raise ValueError(f"{where}.betas={quoted(betas)}: must be two numbers in [0, 1), e.g. (0.9, 0.95).")
