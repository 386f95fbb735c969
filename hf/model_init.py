"""A trainer's `model_init_kwargs` (TRL's configs) as outcore builds the model from `model=` a path.

TRL passes them to `from_pretrained`; outcore builds the model from its config under
`deferred_init()` and reads the weights itself, so each key is taken where it applies, or said:

- `attn_implementation`: the model is built with it;
- `dtype` (or `torch_dtype`): bf16 or fp16 is the run's compute dtype, refused where the trainer's
  `bf16=`/`fp16=` names the other; fp32, "auto" or None leave the trainer's flags to decide;
- `quantization_config`: `Config.quantize` (hf/quantization.py);
- `device_map`: the engine places every shard itself; ignored, said once;
- what only tells `from_pretrained` where to find or how to read files (`revision`,
  `low_cpu_mem_usage`, ...): moot for a local directory, said once;
- any other key sets the model's config, as `from_pretrained` passes such keys on (`use_cache=False`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

_LOADING_ONLY = ("revision", "low_cpu_mem_usage", "use_safetensors", "local_files_only", "cache_dir", "token",
                 "force_download", "subfolder", "variant", "use_kernels", "offload_folder", "offload_state_dict",
                 "key_mapping", "weights_only")
_HALF = {torch.bfloat16: "bf16", torch.float16: "fp16", "bfloat16": "bf16", "float16": "fp16"}
_FULL = (None, "auto", torch.float32, "float32")


@dataclass(frozen=True)
class ModelInit:
    """What `model_init_kwargs` asks of the model outcore builds."""

    attn_implementation: str | None = None
    dtype: str | None = None  # "bf16" or "fp16": the compute dtype they name; None: the trainer's flags decide
    quantization_config: Any = None
    config_overrides: dict[str, Any] = field(default_factory=dict)


def model_init(kwargs: dict[str, Any] | None) -> ModelInit:
    """`kwargs` (a trainer config's `model_init_kwargs`) sorted as the module's docstring says;
    ValueError naming a key outcore cannot honour."""
    rest = dict(kwargs or {})
    if "dtype" in rest and "torch_dtype" in rest:
        raise ValueError("model_init_kwargs gives both dtype and torch_dtype; give one (dtype).")
    dtype = rest.pop("dtype", rest.pop("torch_dtype", None))
    if isinstance(dtype, str) and dtype.startswith("torch."):
        dtype = dtype.removeprefix("torch.")
    if dtype not in _FULL and dtype not in _HALF:
        raise ValueError(f"model_init_kwargs dtype={dtype!r}: outcore computes in float32, bfloat16 or float16.")
    if rest.pop("trust_remote_code", False):
        raise ValueError("model_init_kwargs trust_remote_code=True: outcore builds models transformers ships, from "
                         "local files; leave it False.")
    if "device_map" in rest:
        log.warning("model_init_kwargs device_map=%r is ignored: the engine places every shard itself",
                    rest.pop("device_map"))
    moot = sorted(k for k in rest if k in _LOADING_ONLY)
    if moot:
        log.warning("model_init_kwargs %s: moot for a local directory the engine reads itself; ignored",
                    ", ".join(f"{k}={rest.pop(k)!r}" for k in moot))
    return ModelInit(attn_implementation=rest.pop("attn_implementation", None), dtype=_HALF.get(dtype),
                     quantization_config=rest.pop("quantization_config", None), config_overrides=rest)


def compute_dtype(init: ModelInit, args: Any) -> str | None:
    """The compute dtype `model_init_kwargs` names, where the trainer's flags leave it open; None
    where they decide it. ValueError where they name the other half precision."""
    if init.dtype is None:
        return None
    flag = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
    if flag is not None and flag != init.dtype:
        raise ValueError(f"model_init_kwargs dtype is {init.dtype} and the trainer's arguments set {flag}=True: make "
                         "them agree, or leave dtype out.")
    return init.dtype


@contextlib.contextmanager
def hidden_from_trainer(args: Any) -> Iterator[None]:
    """`args.model_init_kwargs` hidden from the trainer underneath while it is built: outcore took
    them (hf/model_init.py), and TRL would say they were ignored."""
    kwargs = getattr(args, "model_init_kwargs", None)
    if kwargs is None:
        yield
        return
    args.model_init_kwargs = None
    try:
        yield
    finally:
        args.model_init_kwargs = kwargs


def given_quantization(init: ModelInit, kwargs: dict[str, Any]) -> Any:
    """The `BitsAndBytesConfig` given as the trainer's `quantization_config=` (taken out of `kwargs`:
    the model the trainer underneath gets is built) or in `args.model_init_kwargs`; refused in both."""
    given = kwargs.pop("quantization_config", None)
    in_args = init.quantization_config
    if given is not None and in_args is not None:
        raise ValueError("quantization_config is given both to the trainer and in args.model_init_kwargs; give it "
                         "once.")
    return given if given is not None else in_args
