"""The engine's configuration: one validated dataclass, read from code, a file or a DeepSpeed config.

User mistakes raise `ValueError` naming the key and what to do; the settings of a DeepSpeed config
that are read but not used are named in one warning.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

from outcore.offload.io_config import IOConfig
from outcore.offload.typed_fields import check_fields, quoted
from outcore.runtime.config_text import config_format, write_values
from outcore.runtime.deepspeed_config import translate_deepspeed
from outcore.runtime.hyperparameters import check_hyperparameters
from outcore.runtime.policy import ACTIVATION_OFFLOADS, DTYPES, OFFLOADS, STATE_DTYPES
from outcore.runtime.sizes import MOST_BYTES, human_bytes, parse_count, parse_size

MIN_SUB_GROUP_SIZE = 1024  # elements per optimizer chunk at the least
SEEDS = range(2**32)  # Engine's seed=, as numpy and set_seed take it: each unit's seed from it stays in torch's range


MAX_PREFETCH_DEPTH = 1024  # units fetched ahead: far past any model, far short of what overflows a buffer count

QUANTIZE = (None, "nf4", "fp4", "int8")  # Config.quantize: bitsandbytes' 4-bit types and its 8-bit rows


@dataclass
class Config:
    """How the engine shards, where states rest, and how it computes (the README's Config table).

    stage:             1 shards optimizer states; 2 adds gradients; 3 adds parameters.
    offload_params:    where parameter shards rest between uses (stage 3 only).
    offload_optimizer: where fp32 master weights and Adam moments rest.
    nvme_dir:          directory for the per-rank swap files (needed when anything is on "nvme").
    dtype:             compute dtype; fp16 uses dynamic loss scaling.
    state_dtype:       "fp32" (exact AdamW) or "bf16": Adam moments, and the master weights where
                       they are not the fp32 parameters themselves, stored in bf16 (half the
                       optimizer's bytes), updated in fp32 and rounded stochastically.
    prefetch_depth:    fetch units prefetched ahead of use.
    device_budget, host_budget: bytes; None derives them from the machine.
    unit_classes:      module class names that form fetch units (empty: the repeated blocks).
    optimizer:         AdamW keyword arguments used when the Engine is given no optimizer.
    sub_group_size:    elements per optimizer chunk: the optimizer streams [master|m|v] of this
                       many parameters at a time (16 B each with the gradient), whatever the unit size.
    collective_timeout: seconds any collective waits for the other ranks before a stalled or dead
                       rank becomes an error on every rank (used when the engine makes the group).
    offload_activations: "auto", "none", "cpu" or "nvme": where what autograd saves outside the
                       checkpointed units goes until backward (runtime/activation_paging.py).
    loss_chunk_tokens, tile_tokens: a Hugging Face causal LM's loss computed over chunks of this
                       many tokens (its labelled forward then returns no logits) and its decoder
                       MLPs over tiles of this many; "auto": chosen from its shape and the device's
                       free memory; None: whole (hf/chunked_head.py, hf/tiled_mlp.py).
    quantize:          None, "nf4", "fp4" or "int8": frozen Linear weights rest in the tiers quantized
                       as bitsandbytes quantizes them, dequantized as their unit is gathered
                       (runtime/quantized.py); `quantize_double` quantizes a 4-bit weight's scales too.
    """

    stage: int = 3
    offload_params: str = "none"
    offload_optimizer: str = "none"
    nvme_dir: str | None = None
    dtype: str = "fp32"
    state_dtype: str = "fp32"
    prefetch_depth: int = 2
    device_budget: int | None = None
    host_budget: int | None = None
    grad_accumulation: int = 1
    grad_clip: float | None = 1.0
    io: IOConfig = field(default_factory=IOConfig)
    unit_classes: tuple[str, ...] = ()
    optimizer: dict[str, Any] = field(default_factory=dict)
    sub_group_size: int = 1 << 22
    collective_timeout: float = 600.0
    quantize: str | None = None
    quantize_double: bool = False
    offload_activations: str = "auto"
    loss_chunk_tokens: int | str | None = None
    tile_tokens: int | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.io, dict):
            self.io = _build(IOConfig, self.io, "io")
        check_fields(self)
        if self.stage not in (1, 2, 3):
            raise ValueError(f"stage={quoted(self.stage)}: use 1, 2 or 3.")
        for key in ("offload_params", "offload_optimizer"):
            if getattr(self, key) not in OFFLOADS:
                raise ValueError(f"{key}={quoted(getattr(self, key))}: use one of {', '.join(OFFLOADS)}.")
        if self.offload_params != "none" and self.stage != 3:
            raise ValueError(f"offload_params={self.offload_params!r} needs stage=3 (stages 1 and 2 keep whole "
                             "parameters on every rank); set stage=3 or offload_params='none'.")
        if self.offload_activations not in ACTIVATION_OFFLOADS:
            raise ValueError(f"offload_activations={quoted(self.offload_activations)}: use one of "
                             f"{', '.join(ACTIVATION_OFFLOADS)}.")
        for key in ("loss_chunk_tokens", "tile_tokens"):
            v = getattr(self, key)
            if not (v is None or v == "auto" or (type(v) is int and v >= 1)):
                raise ValueError(f"{key}={quoted(v)}: give a number of tokens (at least 1), \"auto\" or None.")
        if "nvme" in (self.offload_params, self.offload_optimizer, self.offload_activations) and not self.nvme_dir:
            raise ValueError("nvme_dir is required when offload_params, offload_optimizer or offload_activations is "
                             "'nvme'.")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={quoted(self.dtype)}: use one of {', '.join(DTYPES)}.")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype={quoted(self.state_dtype)}: use one of {', '.join(STATE_DTYPES)}.")
        if not 0 <= self.prefetch_depth <= MAX_PREFETCH_DEPTH:
            raise ValueError(f"prefetch_depth={self.prefetch_depth}: must be between 0 and {MAX_PREFETCH_DEPTH} "
                             "units ahead (2 is the default; more than a model's units ahead prefetches nothing more).")
        if self.grad_accumulation < 1:
            raise ValueError(f"grad_accumulation={self.grad_accumulation}: must be >= 1.")
        if self.grad_clip == 0:  # as DeepSpeed's gradient_clipping and transformers' max_grad_norm read it
            self.grad_clip = None
        if self.grad_clip is not None and not (math.isfinite(self.grad_clip) and self.grad_clip > 0):
            raise ValueError(f"grad_clip={self.grad_clip}: must be a finite number > 0, or 0 or None for no clipping.")
        for key in ("device_budget", "host_budget"):
            v = getattr(self, key)
            if v is not None and not 0 < v <= MOST_BYTES:
                raise ValueError(f"{key}={quoted(v)}: must be a positive number of bytes up to "
                                 f"{human_bytes(MOST_BYTES)}, or None to derive it.")
        if self.sub_group_size < MIN_SUB_GROUP_SIZE:
            raise ValueError(f"sub_group_size={self.sub_group_size}: must be at least {MIN_SUB_GROUP_SIZE} elements.")
        if not (math.isfinite(self.collective_timeout) and self.collective_timeout > 0):
            raise ValueError(f"collective_timeout={self.collective_timeout}: must be a finite number of seconds > 0.")
        _check_optimizer(self.optimizer)
        if self.quantize not in QUANTIZE:
            raise ValueError(f"quantize={quoted(self.quantize)}: use one of {', '.join(map(repr, QUANTIZE))}.")
        if self.quantize_double and self.quantize in (None, "int8"):
            raise ValueError(f"quantize_double=True quantizes the scales of 4-bit weights, and quantize is "
                             f"{quoted(self.quantize)}: set quantize='nf4' or 'fp4' too, or leave quantize_double off.")

    # -- readers ----------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        return _build(cls, data, "config")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Config:
        """Read a .json, .yaml/.yml or .toml file holding the fields of `Config`."""
        return cls.from_dict(cls.file_values(path))

    @staticmethod
    def file_values(path: str | os.PathLike) -> dict[str, Any]:
        """The settings a config file holds, parsed but not yet checked together (a caller may add
        to them first, as `outcore train` adds a scratch nvme_dir)."""
        path = os.fspath(path)
        ext = config_format(path)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise ValueError(f"cannot read config {path!r}: {e.strerror}") from e
        try:
            if ext == ".json":
                data = json.loads(raw)
            elif ext == ".toml":
                data = tomllib.loads(raw.decode())
            else:
                import yaml

                data = yaml.safe_load(raw)
        except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"config {path!r} does not parse: {e}") from e
        except Exception as e:
            if type(e).__module__.startswith("yaml"):
                raise ValueError(f"config {path!r} does not parse: {_yaml_problem(e)}") from e
            raise
        if not isinstance(data, dict):
            raise ValueError(f"config {path!r} must hold a mapping of settings.")
        for key, value in data.items():
            if _expands_past(value, _MOST_FILE_VALUES):
                raise ValueError(f"config {path!r}: {key!s:.80} holds more than {_MOST_FILE_VALUES:,} values (a YAML "
                                 "alias repeats what it names); a setting is a few values: write it out.")
        return data

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["unit_classes"] = list(self.unit_classes)
        return d

    def to_file(self, path: str | os.PathLike) -> None:
        """Write in the format its suffix names, as `from_file` reads (.json, .yaml/.yml, .toml);
        `from_file` reads it back equal."""
        write_values(path, self.to_dict())

    @classmethod
    def from_deepspeed(cls, ds: dict[str, Any] | str | os.PathLike) -> Config:
        """Translate a DeepSpeed ds_config, a mapping or the path of its JSON file (as
        `deepspeed.initialize(config=...)` takes either); every key read but not used is warned
        about once."""
        if not isinstance(ds, (str, os.PathLike)):
            return cls.from_dict(translate_deepspeed(ds))
        path = os.fspath(ds)
        try:
            with open(path) as f:
                loaded = json.load(f)
        except OSError as e:
            raise ValueError(f"cannot read DeepSpeed config {path!r}: {e.strerror}") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"DeepSpeed config {path!r} is not JSON: {e}") from e
        return cls.from_dict(translate_deepspeed(loaded))


def _check_optimizer(hp: dict[str, Any]) -> None:
    """The AdamW keywords: known names, finite numbers in torch.optim.AdamW's ranges."""
    unknown = set(hp) - {"lr", "betas", "eps", "weight_decay"}
    if unknown:
        raise ValueError(f"optimizer: unknown key(s) {sorted(unknown)}; AdamW takes lr, betas, eps, weight_decay.")
    check_hyperparameters(hp, "optimizer")
    if "betas" in hp:
        hp["betas"] = tuple(float(b) for b in hp["betas"])


# Settings a file or mapping may write as the command line does: sizes in bytes ("256M") and counts ("4M").
_SIZES = ("device_budget", "host_budget", "block_size")
_COUNTS = ("sub_group_size",)


def _build(cls, data: dict[str, Any], what: str):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{what}: unknown key(s) {unknown}; known keys are {sorted(names)}.")
    data = dict(data)
    for key, parse in [(k, parse_size) for k in _SIZES] + [(k, parse_count) for k in _COUNTS]:
        if isinstance(data.get(key), str):
            try:
                data[key] = parse(data[key])
            except ValueError as e:
                where = "" if what == "config" else f"{what}."  # as the kind checks name a key
                raise ValueError(f"{where}{key}={quoted(data[key])}: {e}.") from None
    try:
        return cls(**data)
    except TypeError as e:
        raise ValueError(f"{what}: {e}") from e


_MOST_FILE_VALUES = 10_000  # values one setting of a file may expand to; a YAML alias bomb is billions


def _expands_past(value: Any, most: int) -> bool:
    """Whether `value` (parsed file data) holds more than `most` values, counted as expanded, in time
    bounded by `most`: YAML aliases share one object many times over, which a walk would visit in full."""
    stack, seen = [value], 0
    while stack:
        item = stack.pop()
        seen += 1
        if seen > most:
            return True
        if isinstance(item, dict):
            stack += list(item.keys()) + list(item.values())
        elif isinstance(item, (list, tuple)):
            stack += item
    return False


def _yaml_problem(error: Exception) -> str:
    """PyYAML's message on one line: its own spans several (the context, then the line quoted
    with a caret under the column)."""
    problem, mark = getattr(error, "problem", None), getattr(error, "problem_mark", None)
    if problem is None or mark is None:
        return " ".join(str(error).split())
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
