"""Any range of a unit's states, read from a checkpoint's rank files whatever world size wrote them.

A checkpoint cuts each unit by the unit layout (its parameters' offsets in the flat buffer), and
each of its N rank files holds that rank's shard: per optimizer chunk `u<i>.opt<c>` the fp32
`[master | exp_avg | exp_avg_sq]` of elements [shard·r + start, shard·r + end), and for a frozen
unit its parameters `u<i>.param` in the compute dtype, unless the unit was read where the weights
lie: meta.json then records its spans of the weights files and their checksums
(runtime/frozen_in_place.py), and they are read from there once the checksums match.
`CheckpointShards` reassembles elements [lo, hi) of the whole unit from the files that hold them,
so that M ranks can resume what N wrote (each reads the pieces of its own new shard) and
`outcore export` can rebuild each parameter.
A unit that rested quantized is rebuilt from its unquantized originals, or decoded from the
pre-quantized bytes it was read from (runtime/checkpoint/quantized_values.py), a unit at a time.
Elements past the unit's parameters are padding and read as zeros. Only the slices needed are read.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from safetensors import safe_open

from outcore.offload.file_source import FileStamp
from outcore.runtime.checkpoint.quantized_values import quantized_values
from outcore.runtime.frozen_in_place import UnitSpans, spans_from_json, verified_stamps

MASTER, EXP_AVG, EXP_AVG_SQ = 0, 1, 2


class CheckpointShards:
    """The rank files of one checkpoint folder, opened (and verified, by `verify(name)`) on first use."""

    def __init__(self, folder: str, meta: dict, verify: Callable[[str], str] | None = None) -> None:
        self.folder, self.meta = folder, meta
        self.world = int(meta["world_size"])
        self._verify = verify
        self._files: dict[int, object] = {}
        self._in_place: dict[int, UnitSpans] = {}
        self._stamps: dict[str, FileStamp] = {}  # weights files found to hold what the checkpoint recorded
        self._decoded: tuple[int, torch.Tensor] | None = None  # the quantized unit last decoded: one at a time

    def open_for(self, spans: list[tuple[int, int, int]]) -> None:
        """Open (so verify) every rank file that holds some of `spans` (unit index, lo, hi), and rank
        0's (the buffers): a loader checks what it will read before it overwrites anything."""
        for rank in sorted({0} | {r for index, lo, hi in spans for r in self._ranks(index, lo, hi)}):
            self._file(rank)
        for index, _, _ in spans:
            self.in_place(index)

    def in_place(self, index: int) -> UnitSpans | None:
        """Where frozen unit `index` lies in the weights files, when the checkpoint refers to them
        instead of holding its bytes; its files are checked against their recorded checksums first
        (a ValueError naming one that differs)."""
        entries = self.meta["units"][index].get("in_place")
        if not entries:
            return None
        if index not in self._in_place:
            self._in_place[index] = self.spans(entries)
        return self._in_place[index]

    def spans(self, entries: list[dict]) -> UnitSpans:
        """Spans of the weights files as meta.json records them, their files checked against the
        checksums it records (a ValueError naming one that differs)."""
        files = sorted({e["file"] for e in entries})
        unchecked = {f: self.meta["weights_files"][f] for f in files if f not in self._stamps}
        self._stamps.update(verified_stamps(unchecked, f"checkpoint {self.folder!r}"))
        return spans_from_json(entries, {f: self._stamps[f] for f in files})

    def _ranks(self, index: int, lo: int, hi: int) -> range:
        """The ranks whose shard of unit `index` holds some of elements [lo, hi)."""
        shard = self.meta["units"][index]["shard"]
        return range(lo // shard, min(self.world, -(-hi // shard)))

    def _file(self, rank: int):
        f = self._files.get(rank)
        if f is None:
            name = f"rank{rank}.safetensors"
            path = self._verify(name) if self._verify else os.path.join(self.folder, name)
            f = self._files[rank] = safe_open(path, framework="pt")
        return f

    def buffers(self, prefix: str) -> dict[str, torch.Tensor]:
        """Model buffers (every rank file holds them), keys without `prefix`."""
        f = self._file(0)
        return {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}

    def of_rank(self, rank: int, name: str) -> torch.Tensor | None:
        """Tensor `name` of rank `rank`'s own file, or None where it has none."""
        f = self._file(rank)
        return f.get_tensor(name) if name in f.keys() else None

    def state(self, index: int, lo: int, hi: int, part: int) -> torch.Tensor:
        """Elements [lo, hi) of unit `index`'s fp32 master, exp_avg or exp_avg_sq (`part`)."""
        out = torch.zeros(hi - lo, dtype=torch.float32)
        for rank, base, (c, (start, end)) in self._pieces(index, lo, hi):
            a, b = max(lo, base + start), min(hi, base + end)
            n = end - start
            piece = self._file(rank).get_slice(f"u{index}.opt{c}")
            out[a - lo : b - lo] = piece[part * n + a - base - start : part * n + b - base - start]
        return out

    def params(self, index: int, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of frozen unit `index`'s parameters, in the dtype they were saved in
        (fp32 for those read from the weights files)."""
        spans = self.in_place(index)
        if spans is not None:
            values = torch.empty(hi - lo, dtype=torch.float32)
            spans.source(lo, hi).read_into(values)
            return values
        shard = self.meta["units"][index]["shard"]
        out: torch.Tensor | None = None
        for rank in self._ranks(index, lo, hi):
            base = rank * shard
            a, b = max(lo, base), min(hi, base + shard)
            piece = self._file(rank).get_slice(f"u{index}.param")[a - base : b - base]
            if out is None:
                out = torch.zeros(hi - lo, dtype=piece.dtype)
            out[a - lo : b - lo] = piece
        return out if out is not None else torch.zeros(hi - lo)

    def parameter(self, index: int, param: dict) -> torch.Tensor:
        """One parameter of unit `index` (a `meta["units"][i]["params"]` entry), whole, in fp32."""
        numel = 1
        for d in param["shape"]:
            numel *= d
        lo = param["offset"]
        if self.meta["units"][index].get("quantized"):
            if self._decoded is None or self._decoded[0] != index:
                self._decoded = index, quantized_values(self.meta["units"][index], self.spans)
            return self._decoded[1][lo : lo + numel].view(param["shape"])
        if self.meta["units"][index].get("frozen"):
            return self.params(index, lo, lo + numel).float().view(param["shape"])
        return self.state(index, lo, lo + numel, MASTER).view(param["shape"])

    def _pieces(self, index: int, lo: int, hi: int):
        unit = self.meta["units"][index]
        shard = unit["shard"]
        for rank in self._ranks(index, lo, hi):
            base = rank * shard
            for c, (start, end) in enumerate(unit["chunks"]):
                if max(lo, base + start) < min(hi, base + end):
                    yield rank, base, (c, (start, end))

    def close(self) -> None:
        self._files.clear()
