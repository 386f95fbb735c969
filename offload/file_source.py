"""A key whose bytes are read from files the store does not own: a frozen base, read where it lies.

[Note: read in place] Frozen parameters never change, and a fine-tuned model's are already on
disk, in its weights files. Copying them into the swap file cost a whole write of the base at the
start (in the compute dtype: twice the bytes of a bf16 file under fp32 compute) and twice the reads
every pass. A key with a `FileSource` instead rests on its `FileSpan`s, each a run of elements in
some file, in the file's dtype; a fetch reads them and converts on the way in. Such a key is never
dirty: the store drops it from memory without writing, and refuses a change to it.

The files are the user's: opened read-only, never written, and checked at every read against the
`FileStamp` taken when their headers were checked (size, modification time, inode), so a file
replaced or rewritten during the run is refused at its next read, never read as other weights. Reads
go through the store's I/O engine (counted with its other reads), and the pages they pass through
are dropped from the page cache after, as the swap file's O_DIRECT reads never enter it. A
span already in the key's dtype is read straight into the key's memory, and one widened (bf16 to
fp32) is read into the end of its own place and widened front to back: either way in one request,
which the I/O engine spreads over its threads. Only a narrowing conversion stages `PIECE` bytes at a
time, in one buffer per reading thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from outcore.offload.backends import IOEngine
from outcore.offload.checksum import CHECKSUM_NAME, block_checksum
from outcore.offload.errors import StorageError
from outcore.offload.io_engine import IOFile, ShortIOError

PIECE = 8 << 20  # bytes converted at a time: the staging each reading thread holds
_staging = threading.local()


class WeightsFileChanged(StorageError):
    """A weights file a key reads from is not the one checked at the start."""


@dataclass(frozen=True, slots=True)
class FileStamp:
    """What identifies a file's contents cheaply: checked before every read."""

    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, path: str, fd: int | None = None) -> FileStamp:
        st = os.fstat(fd) if fd is not None else os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)

    def differs(self, now: FileStamp) -> str | None:
        """What changed between this stamp and `now`, in words; None if nothing did."""
        if (self.inode, self.device) != (now.inode, now.device):
            return "it was replaced by another file"
        if self.size != now.size:
            return f"its size went from {self.size:,} to {now.size:,} bytes"
        if self.mtime_ns != now.mtime_ns:
            return "it was modified"
        return None


@dataclass(frozen=True, slots=True)
class FileSpan:
    """Elements [at, at + numel) of a key are `numel` elements of `dtype` at byte `begin` of `path`."""

    path: str
    begin: int
    dtype: torch.dtype
    numel: int
    at: int

    def part(self, lo: int, hi: int, shift: int) -> FileSpan | None:
        """The span's elements that fall in [lo, hi), placed `shift` elements lower; None if none do."""
        a, b = max(lo, self.at), min(hi, self.at + self.numel)
        if a >= b:
            return None
        return FileSpan(self.path, self.begin + (a - self.at) * self.dtype.itemsize, self.dtype, b - a, a - shift)


class FileSource:
    """The bytes of one key of `numel` elements, from `spans` (elements no span covers are zeros)."""

    def __init__(self, spans: Sequence[FileSpan], numel: int, stamps: dict[str, FileStamp]) -> None:
        self.spans = sorted(spans, key=lambda s: (s.path, s.begin))  # each file read front to back
        self.numel = numel
        self.stamps = {s.path: stamps[s.path] for s in self.spans}
        self.by_file: dict[str, list[FileSpan]] = {}
        for s in self.spans:
            self.by_file.setdefault(s.path, []).append(s)
        covered = sorted((s.at, s.at + s.numel) for s in self.spans)
        self.gaps: list[tuple[int, int]] = []  # padding, zero-filled
        end = 0
        for a, b in covered:
            assert a >= end and b <= numel, "spans overlap or run past the key"
            if a > end:
                self.gaps.append((end, a))
            end = b
        if end < numel:
            self.gaps.append((end, numel))

    @property
    def nbytes_read(self) -> int:
        """Bytes one read takes from the files."""
        return sum(s.numel * s.dtype.itemsize for s in self.spans)

    def read_into(self, out: torch.Tensor, engine: IOEngine | None = None) -> None:
        """Fill `out` (flat, on the CPU, `numel` elements) from the files, through `engine` when
        given (else read here); WeightsFileChanged if a file is not the one stamped."""
        assert out.dim() == 1 and out.numel() == self.numel and out.device.type == "cpu"
        for a, b in self.gaps:
            out[a:b].zero_()
        for path, spans in self.by_file.items():
            fd = _open(path)
            try:
                why = self.stamps[path].differs(FileStamp.of(path, fd))
                if why is not None:
                    raise WeightsFileChanged(
                        f"weights file {path!r} changed during the run ({why}): the frozen parameters read from it "
                        "would not be the ones checked at the start. Put the original file back, or start again "
                        "(from the last checkpoint).")
                for span in spans:
                    _read_span(fd, path, span, out, engine)
                _drop_cached(fd, spans)
            finally:
                os.close(fd)


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as e:
        raise WeightsFileChanged(f"weights file {path!r} can no longer be read ({e.strerror}); the frozen "
                                 "parameters are read from it during the run. Put it back, or start again.") from e


def _read_span(fd: int, path: str, span: FileSpan, out: torch.Tensor, engine: IOEngine | None) -> None:
    """One span into its elements of `out`, converted: in one read where the converted span is at
    least as wide as the stored one (the I/O engine then splits it over all its threads), else a
    staging piece at a time."""
    item, wide = span.dtype.itemsize, out.dtype.itemsize
    target = out[span.at : span.at + span.numel]
    if span.dtype == out.dtype:  # no conversion: straight into the key's memory
        _read(fd, path, span.begin, target.view(torch.uint8).numpy(), engine)
        return
    if wide >= item:
        _read_widened(fd, path, span, target, engine)
        return
    staging = _staging_piece()
    step = PIECE // item
    for first in range(0, span.numel, step):
        n = min(step, span.numel - first)
        raw = staging[: n * item]
        _read(fd, path, span.begin + first * item, raw, engine)
        target[first : first + n].copy_(torch.from_numpy(raw).view(span.dtype))


def _read_widened(fd: int, path: str, span: FileSpan, target: torch.Tensor, engine: IOEngine | None) -> None:
    """The stored bytes land in the last part of `target`'s own memory, then widen front to back in
    pieces: piece k's output ends where the stored bytes of piece k + 1 begin or before, so only the
    pieces near the end, whose output reaches their own stored bytes, are copied out first."""
    n, item, wide = span.numel, span.dtype.itemsize, target.dtype.itemsize
    raw = target.view(torch.uint8)
    shift = n * (wide - item)  # where the stored bytes start in `raw`
    _read(fd, path, span.begin, raw[shift:].numpy(), engine)
    stored = raw[shift:].view(span.dtype)
    step = PIECE // wide
    for first in range(0, n, step):
        m = min(step, n - first)
        source = stored[first : first + m]
        if (first + m) * wide > shift + first * item:  # the output would overwrite these bytes as it goes
            source = source.clone()
        target[first : first + m].copy_(source)


def _read(fd: int, path: str, offset: int, array: np.ndarray, engine: IOEngine | None) -> None:
    try:
        if engine is not None:
            engine.read(IOFile(path, fd, False), offset, array).wait()
            return
        view = memoryview(array)  # type: ignore[arg-type]  # numpy arrays export the buffer protocol
        while len(view):
            n = os.preadv(fd, [view], offset)
            if n == 0:
                raise ShortIOError(0, "the file ends early")
            view, offset = view[n:], offset + n
    except ShortIOError as e:
        raise WeightsFileChanged(f"weights file {path!r} ends before the tensor at byte {offset:,}: it was "
                                 "truncated during the run. Put the original file back, or start again.") from e


def _staging_piece() -> np.ndarray:
    piece = getattr(_staging, "piece", None)
    if piece is None or len(piece) != PIECE:
        piece = _staging.piece = np.empty(PIECE, dtype=np.uint8)
    return piece


def _drop_cached(fd: int, spans: Iterable[FileSpan]) -> None:
    """The pages just read leave the page cache: read once a pass, they would only push out others'."""
    for s in spans:
        os.posix_fadvise(fd, s.begin, s.numel * s.dtype.itemsize, os.POSIX_FADV_DONTNEED)


def file_checksum(path: str) -> str:
    """The checksum of a whole file's bytes: `block_checksum` of each PIECE, combined; its text
    names the algorithm, so that a reader with another one knows it cannot compare."""
    crcs = []
    buf = np.empty(PIECE, dtype=np.uint8)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(memoryview(buf)):  # type: ignore[arg-type]
            crcs.append(block_checksum(memoryview(buf)[:n]))  # type: ignore[arg-type]
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    combined = block_checksum(np.asarray(crcs, dtype="<u4").tobytes())
    return f"{CHECKSUM_NAME}:{combined:08x}"
