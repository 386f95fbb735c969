"""Small models for the engine's tests: a GPT-like stack (tied or untied embeddings) and an MLP."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # no in-projection bias: the key bias has an exactly-zero gradient, whose rounding noise
        # AdamW would amplify into different (but equally meaningless) values on either side
        self.attn = nn.MultiheadAttention(d, heads, bias=False, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 3, seq: int = 16,
                 tied: bool = True, checkpointing: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        self.checkpointing = checkpointing

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.checkpointing else b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(n: int, batch: int = 4, seq: int = 16, vocab: int = 64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out
