"""A DeepSpeed ds_config translated into the fields of `outcore.Config`.

Every key outcore reads is mapped to its own setting; every key it reads but does not use is
warned about once, by name, so that nothing a user set is dropped without a word.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def translate_deepspeed(ds: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    io: dict[str, Any] = {}

    def ignored(key: str) -> None:
        log.warning("from_deepspeed: %s is not used by outcore and was ignored", key)

    def given(v: Any) -> bool:
        return v is not None and v != "auto"

    for key, value in ds.items():
        if key == "zero_optimization":
            z = value or {}
            if given(z.get("stage")):
                out["stage"] = int(z["stage"])
            if given(z.get("sub_group_size")):
                out["sub_group_size"] = int(z["sub_group_size"])
            for ds_key, ours in (("offload_param", "offload_params"), ("offload_optimizer", "offload_optimizer")):
                o = z.get(ds_key)
                if not o:
                    continue
                out[ours] = o.get("device", "none")
                if o.get("nvme_path"):
                    out["nvme_dir"] = o["nvme_path"]
                for sub in sorted(set(o) - {"device", "nvme_path"}):
                    ignored(f"zero_optimization.{ds_key}.{sub}")
            for sub in sorted(set(z) - {"stage", "sub_group_size", "offload_param", "offload_optimizer"}):
                ignored(f"zero_optimization.{sub}")
        elif key == "aio":
            for ds_key, ours in (("block_size", "block_size"), ("queue_depth", "queue_depth"),
                                 ("intra_op_parallelism", "threads"), ("thread_count", "threads")):
                if given(value.get(ds_key)):
                    io[ours] = int(value[ds_key])
            for sub in sorted(set(value) - {"block_size", "queue_depth", "intra_op_parallelism", "thread_count"}):
                ignored(f"aio.{sub}")
        elif key in ("bf16", "fp16"):
            if value.get("enabled") and value.get("enabled") != "auto":
                out["dtype"] = key
            for sub in sorted(set(value) - {"enabled"}):
                ignored(f"{key}.{sub}")
        elif key == "gradient_clipping":
            if given(value):
                out["grad_clip"] = float(value) if float(value) > 0 else None
        elif key == "gradient_accumulation_steps":
            if given(value):
                out["grad_accumulation"] = int(value)
        elif key == "optimizer":
            kind = str(value.get("type", "AdamW")).lower()
            if kind not in ("adamw", "adam"):
                raise ValueError(f"optimizer.type={value.get('type')!r}: outcore provides AdamW only.")
            params = value.get("params", {})
            opt = {k: params[k] for k in ("lr", "eps", "weight_decay") if given(params.get(k))}
            if given(params.get("betas")):
                opt["betas"] = tuple(params["betas"])
            for sub in sorted(set(params) - {"lr", "betas", "eps", "weight_decay"}):
                ignored(f"optimizer.params.{sub}")
            out["optimizer"] = opt
        else:
            ignored(key)
    if io:
        out["io"] = io
    return out
