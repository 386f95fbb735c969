"""Text tokenized by a model's own tokenizer, packed into sequences: what `outcore train --model`
trains on. A `.jsonl` file gives one document per row: its "text", or its "messages" (a conversation:
role and content per turn) rendered by the tokenizer's chat template, as transformers'
`apply_chat_template` writes it; any other file is one document.
Documents are joined with the tokenizer's end-of-sequence token into one stream of token ids, whose
last 5% (at least two sequences' worth) is held out for validation. Batches are windows of the
stream at seeded random offsets, so a run and its resumption see the same ones."""

from __future__ import annotations

import torch

from outcore.tools.corpus import documents, window_starts


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


def token_corpus(path: str, tokenizer, seq: int) -> tuple[TokenCorpus, TokenCorpus]:
    """The training and held-out parts of `path`, tokenized and packed."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in documents(path, chat=lambda messages: chat_text(tokenizer, messages)):
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


def chat_text(tokenizer, messages: list) -> str:
    """A conversation as the model's chat template writes it (with its own special tokens, so the
    text is tokenized without adding more)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template (chat_template in tokenizer_config.json or "
                         "chat_template.jinja); give rows of \"text\" instead")
    return tokenizer.apply_chat_template(messages, tokenize=False)
