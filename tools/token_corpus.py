"""Text tokenized by a model's own tokenizer, packed into sequences: what `outcore train --model`
trains on. A `.jsonl` file gives one document per row under "text"; any other file is one document.
Documents are joined with the tokenizer's end-of-sequence token into one stream of token ids, whose
last 5% (at least two sequences' worth) is held out for validation. Batches are windows of the
stream at seeded random offsets, so a run and its resumption see the same ones."""

from __future__ import annotations

import json

import torch

from outcore.tools.corpus import window_starts


class TokenCorpus:
    def __init__(self, tokens: torch.Tensor, name: str) -> None:
        self.tokens, self.name = tokens, name

    def batch(self, batch: int, seq: int, generator: torch.Generator, shard: tuple[int, int] = (0, 1)) -> torch.Tensor:
        """`batch` windows of `seq` tokens (a causal LM shifts its labels itself); this rank's rows
        of the global batch (`window_starts`)."""
        if len(self.tokens) <= seq:
            raise ValueError(f"{self.name} has {len(self.tokens)} tokens, too few for sequences of {seq}; "
                             "give more text or a smaller --seq.")
        starts = window_starts(len(self.tokens) - seq, batch, generator, shard)
        return torch.stack([self.tokens[s : s + seq] for s in starts]).long()


def documents(path: str) -> list[str]:
    """The texts of `path`: JSONL rows' "text", or the whole file."""
    try:
        with open(path, encoding="utf-8") as f:
            if not path.endswith(".jsonl"):
                return [f.read()]
            rows = []
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"--data {path!r} line {n} is not JSON ({e.msg}).") from e
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise ValueError(f"--data {path!r} line {n} has no \"text\" string; JSONL rows look like "
                                     '{"text": "..."}.')
                rows.append(row["text"])
            return rows
    except OSError as e:
        raise ValueError(f"--data {path!r} cannot be read ({e.strerror}).") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"--data {path!r} is not UTF-8 text ({e.reason}).") from e


def token_corpus(path: str, tokenizer, seq: int) -> tuple[TokenCorpus, TokenCorpus]:
    """The training and held-out parts of `path`, tokenized and packed."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in documents(path):
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        if eos is not None:
            ids.append(eos)
    tokens = torch.tensor(ids, dtype=torch.int32)
    held = max(2 * (seq + 1), len(tokens) // 20)
    if len(tokens) < held + seq + 1:
        raise ValueError(f"--data {path!r} has {len(tokens)} tokens, too few for sequences of {seq} and a "
                         "held-out split; give more text or a smaller --seq.")
    return (TokenCorpus(tokens[:-held], f"{path!r} (training part)"),
            TokenCorpus(tokens[-held:], f"{path!r} (held-out part)"))
