"""Several `--data` files as one fine-tuning set: each file's samples read and labelled as its own
format says (hf/sft_rows.py), then concatenated, or mixed by weight.

`FILE:W` gives a file weight W. With weights, the mixture keeps the files' total sample count and
draws each sample's file with probability W / (sum of the weights), as `datasets.interleave_datasets`
draws by `probabilities`; within a file its samples come in a seeded order, reused in a new order when
it runs out. Without weights the files' samples follow one another. A file's held-out share is split
off before mixing, so no held-out sample is also trained on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from outcore.hf.sft_rows import FORMATS, IGNORE, Sample


@dataclass(frozen=True)
class DataFile:
    path: str
    weight: float | None = None  # None: concatenated as is


def data_file(spec: str) -> DataFile:
    """`FILE` or `FILE:W` (W a positive number). A path that itself ends in `:something` that is not
    a number, or exists as given, is a path."""
    path, sep, weight = spec.rpartition(":")
    if not sep or os.path.exists(spec):
        return DataFile(spec)
    try:
        if not weight.isascii():  # float() also reads other scripts' digits ('٢')
            raise ValueError(weight)
        value = float(weight)
    except ValueError:
        if os.path.exists(path):
            raise ValueError(f"--data {spec!r}: no such file, and {weight!r} after {path!r} is not a weight: FILE:W "
                             f"takes a positive number, e.g. {path}:0.5.") from None
        return DataFile(spec)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"--data {spec!r}: a weight is a positive number, e.g. {path}:0.5.")
    return DataFile(path, value)


@dataclass(frozen=True)
class FileSamples:
    """One file's samples as read (its training part, where a share is held out)."""

    path: str
    fmt: str
    samples: list[Sample]
    weight: float | None = None

    def describe(self, drawn: int | None = None) -> str:
        tokens = sum(len(s.input_ids) for s in self.samples)
        trained = sum(label != IGNORE for s in self.samples for label in s.labels[1:])
        share = f", weight {self.weight:g}: {drawn} samples drawn" if drawn is not None else ""
        return (f"{self.path}: {FORMATS[self.fmt][1]}, {len(self.samples)} samples, "
                f"{100 * trained / max(tokens, 1):.0f}% of tokens carry the loss{share}")


def mixed(files: Sequence[FileSamples], seed: int) -> tuple[list[Sample], list[int]]:
    """The files' samples as one list (see the module's docstring), and how many came from each."""
    weights = [f.weight for f in files]
    if all(w is None for w in weights):
        return [s for f in files for s in f.samples], [len(f.samples) for f in files]
    if any(w is None for w in weights):
        given = next(f.path for f in files if f.weight is None)
        raise ValueError(f"--data {given!r} has no weight while another --data has one: give each file a weight "
                         "(FILE:W), or none to concatenate them.")
    empty = next((f.path for f in files if not f.samples), None)
    if empty is not None:
        raise ValueError(f"--data {empty!r} has no sample to draw; leave it out.")
    g = torch.Generator().manual_seed(seed)
    total = sum(len(f.samples) for f in files)
    probabilities = torch.tensor([float(w) for w in weights if w is not None], dtype=torch.float64)
    probabilities /= probabilities.max()  # weights are relative: scaled so that their sum cannot overflow (1e308)
    picks = torch.multinomial(probabilities, total, replacement=True, generator=g).tolist()
    orders: list[list[int]] = [[] for _ in files]
    out, counts = [], [0] * len(files)
    for i in picks:
        if not orders[i]:
            orders[i] = torch.randperm(len(files[i].samples), generator=g).tolist()
        out.append(files[i].samples[orders[i].pop()])
        counts[i] += 1
    return out, counts
