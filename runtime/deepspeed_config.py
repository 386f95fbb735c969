"""A DeepSpeed ds_config translated into the fields of `outcore.Config`.

Every key outcore reads is mapped to its own setting. The keys it reads but does not use, and the
values left "auto", are named in one warning each (a ds_config written for the Hugging Face Trainer
has dozens), so that nothing a user set is dropped without a word. A value of the wrong shape
(`"aio": 5`, `"bf16": true`, stage 2.7) is one ValueError naming its key path.
"""

from __future__ import annotations

import contextvars
import logging
import math
from typing import Any

log = logging.getLogger(__name__)

_ZERO_KEYS = {"stage", "sub_group_size", "offload_param", "offload_optimizer"}
_AIO_KEYS = {"block_size": "block_size", "queue_depth": "queue_depth", "intra_op_parallelism": "threads",
             "thread_count": "threads"}
_ADAMW_KEYS = ("lr", "eps", "weight_decay")
# The key paths one translation ignored, and those it found "auto": said once at its end.
_said: contextvars.ContextVar[tuple[list[str], list[str]]] = contextvars.ContextVar("said")


def translate_deepspeed(ds: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(ds, dict):
        raise ValueError(f"a DeepSpeed config is a mapping of sections, not {type(ds).__name__}.")
    ignored: list[str] = []
    auto: list[str] = []
    token = _said.set((ignored, auto))
    try:
        out = _translate(ds)
    finally:
        _said.reset(token)
    if ignored:
        log.warning("from_deepspeed: %d setting(s) outcore does not use were ignored: %s%s", len(ignored),
                    ", ".join(ignored), "; for the scheduler, build the same torch scheduler with "
                    "Engine(..., lr_scheduler=...)" if "scheduler" in ignored else "")
    if auto:
        log.warning('from_deepspeed: %s %s "auto", which the Hugging Face Trainer fills in from its own '
                    "arguments; outcore took its own default%s (give values to choose)", ", ".join(auto),
                    "is" if len(auto) == 1 else "are", "" if len(auto) == 1 else "s")
    return out


def _translate(ds: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    io: dict[str, Any] = {}
    for key, value in ds.items():
        if key == "zero_optimization":
            _zero(_section(key, value), out)
        elif key == "aio":
            aio = _section(key, value)
            for ds_key, ours in _AIO_KEYS.items():
                if _given(f"aio.{ds_key}", aio.get(ds_key)):
                    io[ours] = _whole(f"aio.{ds_key}", aio[ds_key])
            _ignore_rest("aio", aio, set(_AIO_KEYS))
        elif key in ("bf16", "fp16"):
            precision = _section(key, value)
            enabled = precision.get("enabled", False)
            if enabled not in (True, False, "auto"):
                raise ValueError(f"from_deepspeed: {key}.enabled={enabled!r}: must be true, false or \"auto\".")
            if _given(f"{key}.enabled", enabled) and enabled:
                if "dtype" in out:
                    raise ValueError("from_deepspeed: bf16.enabled and fp16.enabled are both true; enable one.")
                out["dtype"] = key
            _ignore_rest(key, precision, {"enabled"})
        elif key == "gradient_clipping":
            if _given(key, value):
                clip = _number(key, value)
                out["grad_clip"] = clip if clip > 0 else None  # DeepSpeed's 0: no clipping
        elif key == "gradient_accumulation_steps":
            if _given(key, value):
                out["grad_accumulation"] = _whole(key, value)
        elif key == "optimizer":
            out["optimizer"] = _optimizer(_section(key, value))
        else:
            _ignored(key)
    if io:
        out["io"] = io
    return out


def _zero(z: dict[str, Any], out: dict[str, Any]) -> None:
    if _given("zero_optimization.stage", z.get("stage")):
        stage = _whole("zero_optimization.stage", z["stage"])
        if stage not in (1, 2, 3):
            raise ValueError(f"from_deepspeed: zero_optimization.stage={stage}: outcore shards at stage 1, 2 or 3.")
        out["stage"] = stage
    if _given("zero_optimization.sub_group_size", z.get("sub_group_size")):
        out["sub_group_size"] = _whole("zero_optimization.sub_group_size", z["sub_group_size"])
    for ds_key, ours in (("offload_param", "offload_params"), ("offload_optimizer", "offload_optimizer")):
        if z.get(ds_key) is None:
            continue
        where = f"zero_optimization.{ds_key}"
        o = _section(where, z[ds_key], example='{"device": "nvme", "nvme_path": "/local_nvme"}')
        device = o.get("device", "none")
        if not isinstance(device, str):
            raise ValueError(f"from_deepspeed: {where}.device={device!r}: must be \"none\", \"cpu\" or \"nvme\".")
        out[ours] = device
        if o.get("nvme_path"):
            out["nvme_dir"] = o["nvme_path"]
        _ignore_rest(where, o, {"device", "nvme_path"})
    _ignore_rest("zero_optimization", z, _ZERO_KEYS)


def _optimizer(section: dict[str, Any]) -> dict[str, Any]:
    kind = str(section.get("type", "AdamW")).lower()
    if kind not in ("adamw", "adam"):
        raise ValueError(f"optimizer.type={section.get('type')!r}: outcore provides AdamW only.")
    params = _section("optimizer.params", section.get("params", {}))
    if kind == "adam" and params.get("adam_w_mode", True) is False:
        # DeepSpeed's Adam is AdamW unless adam_w_mode is false: weight decay added to the gradient (L2)
        raise ValueError("from_deepspeed: optimizer \"Adam\" with adam_w_mode false decays weights as L2 in the "
                         "gradient; outcore provides AdamW only, whose decay is decoupled. Use type \"AdamW\".")
    hp: dict[str, Any] = {k: _number(f"optimizer.params.{k}", params[k]) for k in _ADAMW_KEYS
                          if _given(f"optimizer.params.{k}", params.get(k))}
    if _given("optimizer.params.betas", params.get("betas")):
        betas = params["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ValueError(f"from_deepspeed: optimizer.params.betas={betas!r}: must be two numbers, "
                             "e.g. [0.9, 0.999].")
        hp["betas"] = tuple(_number("optimizer.params.betas", b) for b in betas)
    _ignore_rest("optimizer.params", params, set(_ADAMW_KEYS) | {"betas", "adam_w_mode"})
    _ignore_rest("optimizer", section, {"type", "params"})
    return hp


def _section(where: str, value: Any, example: str = '{...}') -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"from_deepspeed: {where}={value!r}: must be a mapping, e.g. \"{where.split('.')[-1]}\": "
                         f"{example}.")
    return value


def _whole(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise ValueError(f"from_deepspeed: {where}={value!r}: must be a whole number.")
    return int(value)


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"from_deepspeed: {where}={value!r}: must be a finite number.")
    return float(value)


def _given(where: str, v: Any) -> bool:
    """Set to a value. "auto" is not one: the Hugging Face Trainer fills it in from its own
    arguments before DeepSpeed reads it; outcore has no such arguments, so it says so once."""
    if v == "auto":
        _said.get()[1].append(where)
        return False
    return v is not None


def _ignore_rest(where: str, section: dict[str, Any], used: set[str]) -> None:
    for sub in sorted(set(section) - used):
        _ignored(f"{where}.{sub}")


def _ignored(key: str) -> None:
    _said.get()[0].append(key)
