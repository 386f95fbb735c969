"""Pretrained weights read straight into the units as they are materialized (`Engine(weights=...)`).

`weights` names a safetensors file or a directory of them: the Hugging Face sharded layout (with
`model.safetensors.index.json`), or any `*.safetensors` files without an index. A directory without
them may hold the layout before safetensors, `pytorch_model*.bin` (`torch.save` files, with
`pytorch_model.bin.index.json` when sharded), whose tensors are found by byte range too
(runtime/formats/torch_pickle.py). Tensors are matched to the model by `model.state_dict()` name; a tied
weight stored under any one of its names fills all of them. Everything is checked before a byte is
read into the engine: a missing or unexpected name, or a shape or dtype that cannot be converted,
is one `ValueError` naming the tensor and its file. A unit's tensors are then read one at a time,
each from its byte range when asked for, so the model is never whole in memory.

A parameter that already holds values (a LoRA adapter created outside `deferred_init()`) keeps
them and need not be in the files. Names are matched as the model's family spells them in its files
(runtime/model_family.py): for a model wrapped by peft, the base model's names, so that the base
model's own files load into it, and a module peft trains whole fills both its frozen original and
its trained copy. A task model on another architecture's files (a classifier on a causal LM's) may
lack the files' head and have its own, outside the base model (`ModelFamily.new_head`).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from outcore.offload.file_source import FileStamp
from outcore.runtime.formats.safetensors_header import read_header
from outcore.runtime.formats.safetensors_stream import ST_DTYPES
from outcore.runtime.formats.torch_pickle import is_torch_save, tensor_extents
from outcore.runtime.model_family import ComposedTensor, ModelFamily, NewHead
from outcore.runtime.stored_quantized import StoredQuantized, stored_quantized
from outcore.runtime.units import ParamSlot

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"  # the Hugging Face layout before safetensors
ST_TO_TORCH = {name: dtype for dtype, name in ST_DTYPES.items()}  # safetensors dtype names to torch
RESAVE = ("save it again as safetensors (safetensors.torch.save_file of its state dict, or save_pretrained), "
          "which outcore streams by byte range")


@dataclass(frozen=True, slots=True)
class StoredTensor:
    file: str
    key: str  # its name in the file
    shape: tuple[int, ...]
    dtype: torch.dtype | None  # None: a dtype torch cannot hold
    begin: int  # byte offset of its data in the file
    nbytes: int


def weight_files(path: str) -> list[str]:
    """The weight files `path` names: a file, or a directory of safetensors files (with or without
    an index), or else of `torch.save` files as Hugging Face names them (`pytorch_model*.bin`)."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ValueError(f"weights={path!r} does not exist; name a .safetensors file or a directory of them.")
    for index, suffix in ((INDEX, ".safetensors"), (PICKLE_INDEX, ".bin")):
        if os.path.exists(os.path.join(path, index)):
            return _indexed_files(path, index)
        files = sorted(os.path.join(path, n) for n in os.listdir(path)
                       if n.endswith(suffix) and (suffix == ".safetensors" or n.startswith("pytorch_model")))
        if files:
            return files
    raise ValueError(f"weights={path!r} holds no .safetensors file (nor a Hugging Face pytorch_model.bin).")


def _indexed_files(path: str, name: str) -> list[str]:
    index = os.path.join(path, name)
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index!r} is not a weight index ({e}).") from e
    files = sorted({os.path.join(path, name) for name in weight_map.values()})
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise ValueError(f"{index!r} names {os.path.basename(missing[0])!r}, which is missing from {path!r} "
                         f"({len(missing)} of its {len(files)} files are).")
    return files


def _read_header(file: str) -> dict[str, StoredTensor]:
    """The tensors a weight file holds: a safetensors file's header, or a `torch.save` file's
    pickle read for byte ranges only (runtime/formats/torch_pickle.py)."""
    if not file.endswith(".safetensors") and is_torch_save(file):
        try:
            extents = tensor_extents(file)
        except (OSError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError) as e:
            raise ValueError(f"{file!r} is a torch.save file outcore cannot stream: {e}; {RESAVE}.") from e
        return {key: StoredTensor(file, key, x.shape, x.dtype, x.begin, x.nbytes) for key, x in extents.items()}
    if _is_legacy_pickle(file):
        raise ValueError(f"{file!r} is a pickle, not in torch.save's zip format (torch 1.6 and later); {RESAVE}.")
    try:
        header = read_header(file)  # every range checked before a byte is used (runtime/formats/safetensors_header.py)
    except OSError as e:
        raise ValueError(f"{file!r} is not a readable safetensors file ({e.strerror}).") from e
    return {key: StoredTensor(file, key, t.shape, ST_TO_TORCH.get(t.dtype), t.begin, t.nbytes)
            for key, t in header.items()}


def _is_legacy_pickle(file: str) -> bool:
    with open(file, "rb") as f:
        return f.read(2) in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")  # a pickle's protocol opcode


class PretrainedWeights:
    """The tensors of `path` by name, checked against a model's parameters and buffers."""

    def __init__(self, path: str, family: ModelFamily) -> None:
        self.path = path
        self.family = family
        self.tensors: dict[str, StoredTensor | ComposedTensor] = {}
        # Each file as its header was checked: a frozen unit read in place later refuses a file that
        # differs (offload/file_source.py [Note: read in place]).
        self.stamps: dict[str, FileStamp] = {}
        for file in weight_files(path):
            file = os.path.abspath(file)
            self.stamps[file] = FileStamp.of(file)
            for key, stored in _read_header(file).items():
                name = family.stored_name(key)
                if name in self.tensors:
                    raise ValueError(f"tensor {key!r} is stored twice: in {self.tensors[name].file!r} and {file!r}.")
                self.tensors[name] = stored
        # Weights saved quantized by bitsandbytes (runtime/stored_quantized.py), out of `tensors`.
        self.quantized: dict[str, StoredQuantized] = stored_quantized(self.tensors)
        self._open: dict[str, int] = {}
        self._converted: set[tuple[torch.dtype, torch.dtype]] = set()
        self._grown: dict[ParamSlot, int] = {}  # a resized vocabulary's slot -> the rows the files hold
        self.new_head: set[str] = set()  # a task head's parameters the files lack (`ModelFamily.new_head`)

    def check(self, slots: Iterable[ParamSlot],
              new: Callable[[ParamSlot], bool] = lambda _slot: False) -> None:
        """Every parameter without values has a tensor of its shape in the files (unless `new` says
        it is the model's own addition, initialized instead: a LoRA adapter), and the files hold
        nothing the model does not; otherwise one ValueError naming the first tensor at fault.
        Stored names are first converted as the model's family converts them (for transformers:
        hf/conversion.py)."""
        model, model_name = self.family.model, self.family.stored_name
        slots = list(slots)
        wanted = {model_name(n) for s in slots for n in s.state_dict_names}
        wanted.update(model_name(n) for n, _ in model.named_buffers())
        self.tensors, converted = self.family.convert_names(self.tensors, wanted)
        if converted:
            log.info("weights: %d stored tensor(s) of %s renamed or merged as transformers loads them",
                     converted, self.path)
        vocabulary = self.family.vocabulary_names()
        head = self.family.new_head(self.path)
        known: set[str] = set()
        for slot in slots:
            names = [model_name(n) for n in slot.state_dict_names]
            known.update(names)
            quantized = self.quantized_of(slot)
            if quantized is not None:
                if quantized.weight.shape != tuple(slot.shape) or not slot.frozen:
                    raise ValueError(f"weights {self.path!r} hold {names[0]!r} quantized, shaped "
                                     f"{list(quantized.weight.shape)}, for a {'' if slot.frozen else 'trainable '}"
                                     f"parameter shaped {list(slot.shape)}: a quantized weight is read as stored, "
                                     "for a frozen parameter of its shape (train LoRA adapters on it).")
                continue
            stored = self.find(slot)
            if stored is None:
                if slot.param is None or not slot.param.is_meta:
                    continue  # it holds values of its own, which it keeps
                outside = head is not None and all(head.outside_base(n) for n in names)
                if outside and (not new(slot) or any(map(self.family.is_trained_copy, slot.state_dict_names))):
                    self.new_head.update(names)  # the task's head, or peft's trained copy of it
                elif not new(slot):
                    raise ValueError(f"weights {self.path!r} have no tensor {names[0]!r}"
                                     + (f" (nor {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else "")
                                     + "; it is a parameter of the model. Name the files of this model.")
                continue
            if set(names) & vocabulary and _grown(stored.shape, tuple(slot.shape)):
                self._grown[slot] = stored.shape[0]
                log.warning("weights: %r has %d rows in %s and %d in the model (its vocabulary was resized): the "
                            "%d new rows start as the mean of the stored ones, as transformers' "
                            "resize_token_embeddings starts them", names[0], stored.shape[0], self.path,
                            slot.shape[0], slot.shape[0] - stored.shape[0])
            held = (self._grown[slot], *slot.shape[1:]) if slot in self._grown else tuple(slot.shape)
            self._check_fits(stored, held, torch.float32, names[0])
        buffers = {model_name(n): b for n, b in model.named_buffers()}
        for name, buf in buffers.items():
            if name in self.tensors:
                self._check_fits(self.tensors[name], tuple(buf.shape), buf.dtype, name)
        known.update(buffers)
        unexpected = sorted(set(self.tensors) - known)
        if head is not None:
            unused = [n for n in unexpected if head.outside_base(n)]
            unexpected = [n for n in unexpected if not head.outside_base(n)]
            for name in unused:
                del self.tensors[name]
            _say_head(head, self.path, sorted(self.new_head), unused)
        if unexpected:
            first = self.tensors[unexpected[0]]
            raise ValueError(f"{first.file!r} holds {first.key!r}, which is not in the model"
                             + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                             + ": these weights are for another model.")

    def head_initializers(self, module_names: dict[nn.Module, str],
                          seed: int) -> dict[nn.Module, Callable[[nn.Module], None]]:
        """How to initialize each module that holds a new parameter of a task head: as transformers
        does, each drawing by its name (so a peft copy of the module starts equal to it)."""
        model_name = self.family.stored_name
        out = {}
        for module, prefix in module_names.items():
            new = sorted(n for n in (model_name(f"{prefix}.{p}" if prefix else p) for p in module._parameters)
                         if n in self.new_head)
            if new:
                out[module] = self.family.head_initializer(prefix, new[0], seed)
        return out

    def holds(self, module_names: dict[nn.Module, str]) -> Callable[[nn.Module, str], bool]:
        """Whether the files hold parameter `name` of a module (named as in `module_names`)."""
        def holds(module: nn.Module, name: str) -> bool:
            prefix = module_names[module]
            stored = self.family.stored_name(f"{prefix}.{name}" if prefix else name)
            return stored in self.tensors or stored in self.quantized
        return holds

    def quantized_of(self, slot: ParamSlot) -> StoredQuantized | None:
        """The parameter's quantized stored weight, where the files hold it so."""
        for name in slot.state_dict_names:
            stored = self.quantized.get(self.family.stored_name(name))
            if stored is not None:
                return stored
        return None

    def find(self, slot: ParamSlot) -> StoredTensor | ComposedTensor | None:
        """The stored tensor of a parameter, under whichever of its (tied) names it was saved."""
        for name in slot.state_dict_names:
            stored = self.tensors.get(self.family.stored_name(name))
            if stored is not None:
                return stored
        return None

    def as_stored(self, slot: ParamSlot) -> StoredTensor | None:
        """The one stored tensor whose bytes are the parameter's value, as stored: None where the value
        is made from several (`ComposedTensor`), or grown (a resized vocabulary)."""
        stored = self.find(slot)
        if isinstance(stored, StoredTensor) and slot not in self._grown and stored.dtype is not None:
            return stored
        return None

    def read_parameter(self, slot: ParamSlot, stored: StoredTensor | ComposedTensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """A parameter's stored value, into `out` (of the parameter's shape) when given, else as read
        (in its stored dtype, for fp32 training). The rows a resized vocabulary added beyond the
        stored ones are set to the stored rows' mean, in fp32."""
        value = self.read(stored, torch.float32)
        rows = self._grown.get(slot)
        if out is None and rows is None:
            return value
        if out is None:
            out = torch.empty(tuple(slot.shape), dtype=torch.float32)
        if rows is None:
            return out.copy_(value)
        out[:rows] = value
        del value
        out[rows:] = out[:rows].mean(dim=0)
        return out

    def read(self, stored: StoredTensor | ComposedTensor, dtype: torch.dtype) -> torch.Tensor:
        """The tensor, read into fresh memory (not mapped: a mapped file's pages would count in RSS
        until it is closed), in its stored dtype; a conversion to `dtype` is said once per pair."""
        if not isinstance(stored, StoredTensor):  # built from several stored tensors (check() made it)
            return self.family.assemble(stored, lambda part: self.read(cast(StoredTensor, part), dtype))
        fd = self._open.get(stored.file)
        if fd is None:
            fd = self._open[stored.file] = os.open(stored.file, os.O_RDONLY)
        assert stored.dtype is not None  # checked
        value = torch.empty(stored.shape, dtype=stored.dtype)
        raw = value.view(-1).view(torch.uint8).numpy()
        done = 0
        while done < stored.nbytes:
            n = os.preadv(fd, [raw[done:]], stored.begin + done)  # type: ignore[list-item]  # numpy exports a buffer
            if n == 0:
                raise ValueError(f"{stored.file!r} ends inside tensor {stored.key!r}: the file is truncated.")
            done += n
        if value.dtype != dtype and (value.dtype, dtype) not in self._converted:
            self._converted.add((value.dtype, dtype))
            log.info("weights: converting %s tensors of %s to %s", value.dtype, self.path, dtype)
        return value

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()

    def _check_fits(self, stored: StoredTensor | ComposedTensor, shape: tuple[int, ...], dtype: torch.dtype,
                    name: str) -> None:
        if stored.shape != shape:
            raise ValueError(f"tensor {stored.key!r} in {stored.file!r} has shape {list(stored.shape)}, the "
                             f"model's {name!r} has {list(shape)}: these weights are for another model or config.")
        convertible = stored.dtype is not None and (
            stored.dtype == dtype or (stored.dtype.is_floating_point and dtype.is_floating_point))
        if not convertible:
            raise ValueError(f"tensor {stored.key!r} in {stored.file!r} is {stored.dtype or 'of an unknown dtype'}, "
                             f"which cannot be converted to the model's {dtype}.")


def _say_head(head: NewHead, path: str, new: list[str], unused: list[str]) -> None:
    if new:
        log.warning("weights: %s holds a %s; the %s's %s %s not in it and start%s as transformers initializes "
                    "a new head", path, head.stored_class, head.model_class, ", ".join(new),
                    "is" if len(new) == 1 else "are", "s" if len(new) == 1 else "")
    if unused:
        log.warning("weights: %s of the stored %s %s no place in the %s and %s left out", ", ".join(unused),
                    head.stored_class, "has" if len(unused) == 1 else "have", head.model_class,
                    "is" if len(unused) == 1 else "are")


def _grown(stored: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether `shape` is `stored` with rows added (a vocabulary resized by resize_token_embeddings)."""
    return len(stored) == len(shape) >= 1 and stored[0] < shape[0] and stored[1:] == shape[1:]
