"""Write a safetensors file tensor by tensor, in bounded memory (the library wants them all at once).

The header is known up front from names, dtypes and shapes; each tensor is then written at its own
offset, in any order. The format: an 8-byte little-endian header length, the JSON header (padded
with spaces to a multiple of 8), then the raw little-endian bytes.
"""

from __future__ import annotations

import json
import os
import struct
import zlib

import torch

from outcore.runtime.formats.written_files import create_file

ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


class SafetensorsWriter:
    """Create `path` for the given (name, dtype, shape) entries; fill it with `write`; `close`."""

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict = {"__metadata__": metadata} if metadata else {}
        self._spans: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
        offset = 0
        for name, dtype, shape in entries:
            if dtype not in ST_DTYPES:
                raise ValueError(f"{name}: dtype {dtype} cannot be stored in safetensors")
            nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._spans[name] = (offset, nbytes, dtype, tuple(shape))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._data_start = 8 + len(raw)
        self.path = path
        self._fd = create_file(path)  # a new file: nothing there is written through
        os.pwrite(self._fd, struct.pack("<Q", len(raw)) + raw, 0)
        os.ftruncate(self._fd, self._data_start + offset)
        self._written: dict[str, int] = {}  # bytes written per entry

    def write(self, name: str, tensor: torch.Tensor) -> None:
        _, _, dtype, shape = self._spans[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: expected {dtype} {shape}, got {tensor.dtype} {tuple(tensor.shape)}")
        self.write_part(name, tensor, 0)

    def write_part(self, name: str, tensor: torch.Tensor, at: int) -> None:
        """Elements [at, at + tensor.numel()) of entry `name`, in its flattened order; the parts of
        an entry may come in any order, but each element exactly once."""
        off, nbytes, dtype, _ = self._spans[name]
        size = dtype.itemsize
        if tensor.dtype != dtype or (at + tensor.numel()) * size > nbytes or at < 0:
            raise ValueError(f"{name}: elements [{at}, {at + tensor.numel()}) of {tensor.dtype} do not fit "
                             f"its {nbytes // size} elements of {dtype}")
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        done, start = 0, self._data_start + off + at * size
        while done < data.nbytes:
            done += os.pwrite(self._fd, data[done:].data, start + done)
        self._written[name] = self._written.get(name, 0) + data.nbytes

    def close(self) -> None:
        """fsync and close; every entry must have been written."""
        missing = [k for k, span in self._spans.items() if self._written.get(k, 0) != span[1]]
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        if missing:
            raise ValueError(f"{self.path}: tensors not written whole: {sorted(missing)[:5]}")

    def abort(self) -> None:
        """Close without checking, after a failure; the caller removes the file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def file_crc32(path: str, chunk: int = 8 << 20) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


class ShardedSafetensorsWriter:
    """A directory of safetensors shards in the Hugging Face layout: `model-0000K-of-0000N.safetensors`
    of at most `max_shard_size` bytes each (a larger tensor gets a shard of its own), and
    `model.safetensors.index.json` mapping each tensor to its shard. Entries are assigned to shards
    in the order given; `write` them in any order, then `close`."""

    def __init__(self, directory: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 max_shard_size: int, metadata: dict[str, str] | None = None) -> None:
        if max_shard_size <= 0:
            raise ValueError(f"max_shard_size={max_shard_size}: must be a positive number of bytes.")
        os.makedirs(directory, exist_ok=True)
        groups: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
        size = 0
        for entry in entries:
            nbytes = torch.Size(entry[2]).numel() * entry[1].itemsize
            if groups[-1] and size + nbytes > max_shard_size:
                groups.append([])
                size = 0
            groups[-1].append(entry)
            size += nbytes
        n = len(groups)
        names = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors" for k in range(n)]
        self.directory = directory
        self._writers = [SafetensorsWriter(os.path.join(directory, name), group, metadata)
                         for name, group in zip(names, groups, strict=True)]
        self._shard_of = {e[0]: k for k, group in enumerate(groups) for e in group}
        self._index = {"metadata": {"total_size": sum(torch.Size(e[2]).numel() * e[1].itemsize for e in entries)},
                       "weight_map": {e[0]: names[k] for k, group in enumerate(groups) for e in group}}
        self.sharded = n > 1

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self._writers[self._shard_of[name]].write(name, tensor)

    def close(self) -> None:
        for w in self._writers:
            w.close()
        if self.sharded:  # one file needs no index (as `save_pretrained` writes it)
            with open(os.path.join(self.directory, "model.safetensors.index.json"), "w") as f:
                json.dump(self._index, f, indent=2)

    def abort(self) -> None:
        for w in self._writers:
            w.abort()
