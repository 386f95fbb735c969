"""`outcore.hf.sft_dataset`: a fine-tuning file as rows of `seq` tokens, packed without cross-talk.

    ds = outcore.hf.sft_dataset("data.jsonl", tokenizer, seq=2048, completion_only=True, packing=True)
    ds[0]   # {"input_ids": LongTensor[seq], "labels": LongTensor[seq], "position_ids": LongTensor[seq]}

Each row of the file becomes a sample (hf/sft_rows.py: its tokens and which carry the loss).
Packing (the default) puts samples one after another into rows of `seq` tokens, in file order, a
sample never split across rows; `position_ids` restart at 0 for each sample, and from them
transformers masks attention per sample (a packed batch given `position_ids` and no attention
mask), so no sample sees another. A sample's first label is -100: no token of the sample before it
predicts it, as none would alone. The summed loss of a packed row is then the sum of its samples'
losses computed one at a time. The tail of a row that no further sample fits is padding, with
labels -100. Without packing each sample has a row of its own, padded the same way; a causal
model's tokens never attend to the padding after them, so no attention mask is needed either way.
A sample longer than `seq` keeps its first `seq` tokens; how many were cut is counted and said (a
text row goes on in pieces instead: `samples_of`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from outcore.hf.data_files import read_rows
from outcore.hf.sft_rows import FORMATS, IGNORE, RowTokenizer, Sample, detect_format

log = logging.getLogger(__name__)


LONG_ROW = 1 << 20  # characters of a row beyond which only a text row is taken (in pieces)


@dataclass(frozen=True)
class Counts:
    samples: int
    truncated: int  # samples longer than seq, cut to it
    tokens: int  # in the rows, padding left out
    trained: int  # tokens that carry the loss
    dropped: int = 0  # rows left out: no token, none trained within seq, or too long (`samples_of`)


class SFTDataset(torch.utils.data.Dataset):
    """Rows of `seq` tokens: input_ids, labels and position_ids, each a LongTensor of length `seq`."""

    def __init__(self, rows: list[list[Sample]], seq: int, pad_id: int, fmt: str, counts: Counts) -> None:
        self.rows, self.seq, self.pad_id, self.format, self.counts = rows, seq, pad_id, fmt, counts

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for sample in self.rows[index]:
            ids += sample.input_ids
            labels += [IGNORE, *sample.labels[1:]]  # no token before it predicts its first
            positions += range(len(sample.input_ids))
        tail = self.seq - len(ids)
        ids += [self.pad_id] * tail
        labels += [IGNORE] * tail
        start = positions[-1] + 1 if positions else 0  # the tail goes on from the last sample: it attends to
        positions += range(start, start + tail)  # what is before it, and nothing before attends to it
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "position_ids": torch.tensor(positions)}

    def row_count(self, seq: int) -> int:
        """Its rows (each `self.seq` tokens): one pass over the samples."""
        return len(self.rows)

    def batch(self, batch: int, seq: int, generator: torch.Generator,
              shard: tuple[int, int] = (0, 1)) -> dict[str, torch.Tensor]:
        """`batch` rows drawn with `generator` (the same draw on every rank), this rank's part of them
        for `shard` = (rank, world): what `outcore train` steps on."""
        assert seq == self.seq, "rows are cut at the dataset's own seq"
        picks = torch.randint(len(self.rows), (batch,), generator=generator).tolist()
        rank, world = shard
        mine = picks[rank * batch // world:(rank + 1) * batch // world]
        items = [self[i] for i in mine]
        return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def sft_dataset(path: str, tokenizer: Any, seq: int, *, completion_only: bool = True, packing: bool = True,
                chat_template: str | None = None) -> SFTDataset:
    """The rows of `path` (hf/data_files.py), tokenized and labelled as SFT tools do, packed or padded."""
    return dataset_of(read_rows(path), path, tokenizer, seq, completion_only=completion_only, packing=packing,
                      chat_template=chat_template)


def dataset_of(rows: list, path: str, tokenizer: Any, seq: int, *, completion_only: bool = True,
               packing: bool = True, chat_template: str | None = None) -> SFTDataset:
    """`sft_dataset` of rows already read."""
    samples, fmt, truncated, dropped = samples_of(rows, path, tokenizer, seq, completion_only=completion_only,
                                                  chat_template=chat_template)
    return packed(samples, seq, tokenizer, fmt, path, packing=packing, truncated=truncated, dropped=dropped)


def samples_of(rows: list, path: str, tokenizer: Any, seq: int, *, completion_only: bool = True,
               chat_template: str | None = None) -> tuple[list[Sample], str, int, int]:
    """The rows' samples, none longer than `seq`, their format, how many were cut, and how many rows
    were dropped. A text row longer than `seq` (a whole `.txt` file is one) goes on in pieces of
    `seq` tokens, each a sample of its own, so none of it is lost (one over LONG_ROW characters is
    tokenized in pieces too: `RowTokenizer.text_pieces`); a longer row of any other format keeps its
    first `seq` tokens. Dropped, counted and said: a row with no token at all (a template that
    renders nothing), one none of whose tokens within `seq` carries the loss (it would train on
    nothing, and a batch of such rows has no loss at all), and a row of another format over
    LONG_ROW characters (cut to `seq` tokens anyway, it would cost its size a hundred times over to
    tokenize). ValueError where no row remains."""
    if seq < 2:
        raise ValueError(f"seq={seq}: rows need at least 2 tokens.")
    fmt = detect_format(rows, path)
    tokens = RowTokenizer(tokenizer, fmt, path, completion_only=completion_only, chat_template=chat_template)
    samples: list[Sample] = []
    truncated, dropped = 0, {"no tokens": 0, f"no trained token within --seq {seq}": 0,
                             f"over {LONG_ROW >> 20} MB": 0}
    for where, row in rows:
        size = _characters(row)
        if size > LONG_ROW and fmt == "text" and isinstance(row["text"], str):
            samples += tokens.text_pieces(where, row["text"], seq)
            continue
        if size > LONG_ROW:
            dropped[f"over {LONG_ROW >> 20} MB"] += 1
            continue
        s = tokens.sample(where, row)
        if len(s.input_ids) > seq and fmt == "text":
            samples += [Sample(s.input_ids[i:i + seq], s.labels[i:i + seq]) for i in range(0, len(s.input_ids), seq)
                        if len(s.input_ids) - i >= 2]
            continue
        if len(s.input_ids) > seq:
            truncated += 1
            s = Sample(s.input_ids[:seq], s.labels[:seq])
        if not s.input_ids:
            dropped["no tokens"] += 1
        elif not s.trains:
            dropped[f"no trained token within --seq {seq}"] += 1
        else:
            samples.append(s)
    left_out = {why: n for why, n in dropped.items() if n}
    if left_out:
        log.warning("%s: %s left out (%s)", path, f"{sum(left_out.values())} of {len(rows)} rows",
                    ", ".join(f"{n}: {why}" for why, n in left_out.items()))
    if not samples:
        raise ValueError(f"{path!r}: none of its {len(rows)} rows can be trained on ("
                         + ", ".join(f"{n}: {why}" for why, n in left_out.items())
                         + "); raise --seq, train on every token (--train-on-prompt), or mend the rows.")
    return samples, fmt, truncated, sum(left_out.values())


def _characters(row: Any) -> int:
    """The characters of a row's strings, however deeply nested (without recursion)."""
    total, todo = 0, [row]
    while todo:
        value = todo.pop()
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, dict):
            todo += value.values()
        elif isinstance(value, (list, tuple)):
            todo += value
    return total


def held_out(samples: list[Sample], fraction: float, seed: int, path: str) -> tuple[list[Sample], list[Sample]]:
    """`samples` split at random (by `seed`) into a training part and a held-out `fraction`, each of
    at least one sample."""
    if not 0 < fraction < 1:
        raise ValueError(f"--eval-split {fraction}: give a fraction between 0 and 1, e.g. 0.05.")
    if len(samples) < 2:
        raise ValueError(f"--data {path!r} makes {len(samples)} sample(s), too few to hold some out: give more "
                         "rows, or the held-out rows apart with --eval-data FILE.")
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    cut = min(len(samples) - 1, max(1, round(fraction * len(samples))))
    held = set(order[:cut])
    return [s for i, s in enumerate(samples) if i not in held], [s for i, s in enumerate(samples) if i in held]


def packed(samples: list[Sample], seq: int, tokenizer: Any, fmt: str, path: str, *, packing: bool = True,
           truncated: int = 0, dropped: int = 0) -> SFTDataset:
    """Samples as rows of `seq` tokens, packed (the default) or one per row; said once in the log."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = _pack(samples, seq) if packing else [[s] for s in samples]
    counts = Counts(len(samples), truncated, sum(len(s.input_ids) for s in samples),
                    sum(label != IGNORE for s in samples for label in s.labels[1:]), dropped)
    what = FORMATS[fmt][1] if fmt in FORMATS else "rows of several formats"
    log.info("%s: %d samples of %s, %s; %d of %d tokens (%.0f%%) carry the loss%s", path, len(samples),
             what, f"packed into {len(rows)} rows of {seq}" if packing else f"one per row of {seq}",
             counts.trained, counts.tokens, 100 * counts.trained / max(counts.tokens, 1),
             f"; {truncated} longer than {seq} tokens were cut to it" if truncated else "")
    return SFTDataset(rows, seq, pad if pad is not None else 0, fmt, counts)


def _pack(samples: list[Sample], seq: int) -> list[list[Sample]]:
    """Samples in order into rows of at most `seq` tokens, a new row where the next one does not fit."""
    rows: list[list[Sample]] = []
    used = seq
    for s in samples:
        if used + len(s.input_ids) > seq:
            rows.append([])
            used = 0
        rows[-1].append(s)
        used += len(s.input_ids)
    return rows
