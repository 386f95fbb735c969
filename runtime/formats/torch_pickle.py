"""Where each tensor of a `torch.save` file lies, so that it can be streamed like a safetensors one.

`torch.save` (since torch 1.6) writes a zip archive: `data.pkl` pickles the object, and each tensor
storage is one uncompressed entry, `data/<key>`. A Hugging Face `pytorch_model*.bin` is such a file
holding a state dict. The pickle is read here by an unpickler that knows only what a state dict of
tensors needs (torch's tensor rebuild function, its storage types, `OrderedDict`); anything else is
refused, so no object the file names is ever built. Each tensor becomes a byte range of the file,
read later as safetensors' are (runtime/pretrained.py): the file is never loaded whole.
"""

from __future__ import annotations

import collections
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

_STORAGE_DTYPES = {"FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
                   "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
                   "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
                   "BoolStorage": torch.bool}
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip entry's local header: signature, ..., name and extra lengths


@dataclass(frozen=True)
class Extent:
    """One tensor of the file: its shape and dtype, and the bytes that hold it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    begin: int
    nbytes: int


def is_torch_save(file: str) -> bool:
    """`torch.save`'s zip format: an archive whose entries include `data.pkl`."""
    if not zipfile.is_zipfile(file):
        return False
    with zipfile.ZipFile(file) as archive:
        return _pickle_entry(archive) is not None


def tensor_extents(file: str) -> dict[str, Extent]:
    """The tensors of the state dict `file` holds, by name; a ValueError saying what else it holds."""
    with zipfile.ZipFile(file) as archive, open(file, "rb") as raw:
        pickled = _pickle_entry(archive)
        assert pickled is not None  # is_torch_save() said so
        prefix = pickled[: -len("data.pkl")]
        order = f"{prefix}byteorder"  # older torch versions wrote none, and little-endian data
        if order in archive.namelist() and archive.read(order) != b"little":
            raise ValueError("its tensors are stored big-endian")
        state = _StateDictUnpickler(archive.open(pickled)).load()
        if not isinstance(state, dict):
            raise ValueError(f"it holds a {type(state).__name__}, not a state dict")
        out, entries = {}, {}  # entries: where each storage's bytes begin, read once (tied names share one)
        for name, tensor in state.items():
            if not isinstance(tensor, _Tensor):
                raise ValueError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
            key = tensor.storage.key
            if key not in entries:
                entries[key] = _data_offset(archive, raw, f"{prefix}data/{key}")
            out[str(name)] = tensor.extent(name, entries[key])
        return out


def _pickle_entry(archive: zipfile.ZipFile) -> str | None:
    return next((n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")), None)


def _data_offset(archive: zipfile.ZipFile, raw: Any, entry: str) -> int:
    """Where the entry's bytes begin in the file: after its local header, which may differ in
    length from the central directory's record of it."""
    info = archive.getinfo(entry)
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"its entry {entry!r} is compressed")
    raw.seek(info.header_offset)
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(raw.read(_LOCAL_HEADER.size))
    if signature != b"PK\x03\x04":
        raise ValueError(f"its entry {entry!r} has no local header")
    return int(info.header_offset + _LOCAL_HEADER.size + name_len + extra_len)


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class _Tensor:
    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def extent(self, name: Any, entry_begin: int) -> Extent:
        numel = 1
        expected = []
        for size in reversed(self.shape):
            expected.append(numel)
            numel *= size
        if any(s != e for size, s, e in zip(self.shape, self.stride, reversed(expected), strict=True) if size > 1):
            raise ValueError(f"{name!r} is a strided view (stride {list(self.stride)})")
        if self.offset + numel > self.storage.numel:
            raise ValueError(f"{name!r} lies past the end of its storage")
        itemsize = self.storage.dtype.itemsize
        return Extent(self.shape, self.storage.dtype, entry_begin + self.offset * itemsize, numel * itemsize)


def _rebuild_tensor(storage: _Storage, offset: int, shape: tuple[int, ...], stride: tuple[int, ...],
                    *_rest: Any) -> _Tensor:
    return _Tensor(storage, int(offset), tuple(int(s) for s in shape), tuple(int(s) for s in stride))


def _rebuild_parameter(data: _Tensor, *_rest: Any) -> _Tensor:
    return data


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _StateDictUnpickler(pickle.Unpickler):
    """Builds tensors as byte ranges, dicts as dicts, and refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return _rebuild_parameter
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise ValueError(f"it pickles {module}.{name}, which is not part of a state dict of tensors")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise ValueError(f"it refers to a storage as {pid!r}")
        return _Storage(str(pid[2]), pid[1].dtype, int(pid[4]))
