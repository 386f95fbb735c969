"""Training text as byte tokens, read from disk on demand: a corpus is a list of file segments.

The default corpus is the Python standard library's own source files on this machine (no
download); `--data PATH` is any UTF-8 text file. Each is split into a training part and a
held-out part, and batches are windows read with `os.pread` at random offsets: the loader holds
the segment list and the batch it is building, never the text. A `.jsonl` file is the exception:
its rows' "text" strings are escaped inside the file, so they are read once and held, joined by
blank lines (as `outcore train --model` holds its token ids).
"""

from __future__ import annotations

import bisect
import os
import sysconfig
from dataclasses import dataclass

import torch

VOCAB = 256  # byte-level tokens
HELD_OUT_EVERY = 20  # stdlib: every 20th file is held out
HELD_OUT_FRACTION = 0.05  # a single file: its last 5% is held out


@dataclass(frozen=True)
class Segment:
    path: str
    start: int
    length: int


class ByteCorpus:
    """Segments of files read as one stream of bytes; windows may span segments."""

    def __init__(self, segments: list[Segment], name: str) -> None:
        self.segments = [s for s in segments if s.length > 0]
        self.name = name
        self._ends: list[int] = []
        total = 0
        for s in self.segments:
            total += s.length
            self._ends.append(total)
        self.nbytes = total

    def read(self, offset: int, n: int) -> bytes:
        """`n` bytes from stream position `offset` (which must leave room for them)."""
        out = bytearray()
        i = bisect.bisect_right(self._ends, offset)
        while len(out) < n:
            seg = self.segments[i]
            seg_start = self._ends[i] - seg.length
            within = offset + len(out) - seg_start
            want = min(n - len(out), seg.length - within)
            fd = os.open(seg.path, os.O_RDONLY)
            try:
                out += os.pread(fd, want, seg.start + within)
            finally:
                os.close(fd)
            i += 1
        return bytes(out)

    def row_count(self, seq: int) -> int:
        """Windows of `seq` bytes in one pass over the text."""
        return self.nbytes // seq

    def batch(self, batch: int, seq: int, generator: torch.Generator,
              shard: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch` random windows of seq+1 bytes: inputs and next-byte targets, int64; rank r of
        `shard` = (r, world) gets its rows of the global batch (`window_starts`)."""
        if self.nbytes <= seq + 1:
            raise ValueError(f"{self.name} has {self.nbytes} bytes; a window needs more than {seq + 1}. "
                             "Give a larger text file or a shorter --seq.")
        starts = window_starts(self.nbytes - seq - 1, batch, generator, shard)
        rows = torch.empty(batch, seq + 1, dtype=torch.uint8)
        for r, s in enumerate(starts):
            rows[r] = torch.frombuffer(bytearray(self.read(s, seq + 1)), dtype=torch.uint8)
        rows = rows.long()
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class TextCorpus(ByteCorpus):
    """Bytes held in memory, read as `ByteCorpus` reads its files."""

    def __init__(self, data: bytes, name: str) -> None:
        super().__init__([], name)
        self.data, self.nbytes = data, len(data)

    def read(self, offset: int, n: int) -> bytes:
        return self.data[offset : offset + n]


def window_starts(positions: int, batch: int, generator: torch.Generator, shard: tuple[int, int]) -> list[int]:
    """Where rank r's `batch` windows start, `shard` = (r, world): its rows of one global batch of
    world x batch windows drawn from `generator`, so that every rank trains on different data and
    N ranks of `batch` see what one rank of N x batch would."""
    rank, world = shard
    starts = torch.randint(0, positions, (batch * world,), generator=generator)
    return starts[rank * batch : (rank + 1) * batch].tolist()


def batch_generator(seed: int, step: int, split: str) -> torch.Generator:
    """The batches of a step depend only on (seed, step, split), so a resumed run sees the same data."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 2 + (split == "val"))


def stdlib_sources(root: str | None = None) -> list[str]:
    """Every .py file of the standard library (site-packages excluded), in a stable order."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        found += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    return found


def stdlib_corpus(root: str | None = None) -> tuple[ByteCorpus, ByteCorpus]:
    """(train, held-out) from the standard library's sources; every 20th file is held out."""
    files = stdlib_sources(root)
    if len(files) < HELD_OUT_EVERY:
        raise ValueError(f"found only {len(files)} standard library sources under "
                         f"{root or sysconfig.get_paths()['stdlib']!r}; pass --data PATH with a text file.")
    segs = [Segment(f, 0, os.path.getsize(f)) for f in files]
    train = [s for i, s in enumerate(segs) if i % HELD_OUT_EVERY]
    held = [s for i, s in enumerate(segs) if i % HELD_OUT_EVERY == 0]
    return ByteCorpus(train, "the stdlib corpus"), ByteCorpus(held, "the stdlib held-out split")


def file_corpus(path: str) -> tuple[ByteCorpus, ByteCorpus]:
    """(train, held-out) from one UTF-8 text file, or a JSONL file's texts; the last 5% is held out."""
    if path.endswith(".jsonl"):
        data = "\n\n".join(documents(path)).encode()
        held = max(1, int(len(data) * HELD_OUT_FRACTION))
        return (TextCorpus(data[:-held], f"the texts of {path!r} (training part)"),
                TextCorpus(data[-held:], f"the texts of {path!r} (held-out part)"))
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(1 << 20)
    except OSError as e:
        raise ValueError(f"--data {path!r}: {e.strerror}; give a readable UTF-8 text file.") from e
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not just a character cut at the sample's edge
            raise ValueError(f"--data {path!r} is not UTF-8 text (byte {e.start}); give a UTF-8 text file.") from e
    held = max(1, int(size * HELD_OUT_FRACTION))
    return (ByteCorpus([Segment(path, 0, size - held)], f"{path!r} (training part)"),
            ByteCorpus([Segment(path, size - held, held)], f"{path!r} (held-out part)"))


def files_corpus(paths: list[str]) -> tuple[ByteCorpus, ByteCorpus]:
    """(train, held-out) from several files, each split as `file_corpus` splits it, the parts one
    after another."""
    if len(paths) == 1:
        return file_corpus(paths[0])
    parts = [file_corpus(p) for p in paths]
    names = ", ".join(repr(p) for p in paths)
    if not any(isinstance(c, TextCorpus) for part in parts for c in part):
        return (ByteCorpus([seg for train, _ in parts for seg in train.segments], f"{names} (training parts)"),
                ByteCorpus([seg for _, held in parts for seg in held.segments], f"{names} (held-out parts)"))
    return (TextCorpus(b"\n\n".join(train.read(0, train.nbytes) for train, _ in parts), f"{names} (training parts)"),
            TextCorpus(b"\n\n".join(held.read(0, held.nbytes) for _, held in parts), f"{names} (held-out parts)"))


def documents(path: str) -> list[str]:
    """The texts of a `.jsonl` file's rows, read as `--model` reads its data (hf/data_files.py);
    a conversation ("messages") needs a model's chat template, so it is refused here, naming its line."""
    from outcore.hf.data_files import read_rows

    texts = []
    for where, row in read_rows(path):
        if isinstance(row.get("text"), str):
            texts.append(row["text"])
        elif "messages" in row:
            raise ValueError(f"--data {path!r} {where} is a conversation (\"messages\"): conversations are rendered "
                             "by a model's chat template, so they train with `outcore train --model DIR`; give presets "
                             "rows of \"text\".")
        else:
            raise ValueError(f"--data {path!r} {where} has neither a \"text\" string nor a \"messages\" list; "
                             'JSONL rows look like {"text": "..."} or {"messages": [{"role": "user", "content": '
                             '"..."}, ...]}.')
    return texts
