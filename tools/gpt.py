"""outcore's own GPT: a pre-norm transformer with learned positions and (optionally) tied embeddings.

Small whole file, read top to bottom: config → block → model. Every module has `reset_parameters`,
so the model can be built under `runtime.deferred_init()` and materialized unit by unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 256
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    tied: bool = True

    @property
    def params(self) -> int:
        d, v = self.d_model, self.vocab
        per_block = 12 * d * d + 13 * d  # qkv, proj, 2 mlp matrices, their biases, 2 norms
        return v * d + self.seq * d + self.layers * per_block + 2 * d + (0 if self.tied else v * d)


PRESETS = {
    "tiny": GPTConfig(vocab=256, seq=128, layers=4, d_model=128, heads=4),
    "gpt-125m": GPTConfig(vocab=32000, seq=1024, layers=12, d_model=768, heads=12),
    "gpt-350m": GPTConfig(vocab=32000, seq=1024, layers=24, d_model=1024, heads=16),
    "gpt-1b": GPTConfig(vocab=32000, seq=2048, layers=24, d_model=2048, heads=16),
    "gpt-2b": GPTConfig(vocab=32000, seq=2048, layers=32, d_model=2304, heads=18),
    "gpt-3b": GPTConfig(vocab=32000, seq=2048, layers=32, d_model=2816, heads=22),
    "gpt-7b": GPTConfig(vocab=32000, seq=2048, layers=32, d_model=4096, heads=32),
    # the reference shape of the engine benchmark: 12 x 768, vocab 32000, untied (134M parameters)
    "bench-134m": GPTConfig(vocab=32000, seq=256, layers=12, d_model=768, heads=12, tied=False),
}


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj.residual = True  # feeds the residual stream: initialized smaller (see _init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.out.residual = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, *, checkpoint_activations: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.checkpoint_activations = checkpoint_activations  # keep block inputs only; recompute in backward
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tied:
            self.head.weight = self.tok.weight
        for m in self.modules():
            _init(m, cfg)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy when `targets` are given."""
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            if self.checkpoint_activations and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _init(m: nn.Module, cfg: GPTConfig) -> None:
    """GPT-2 style: N(0, 0.02) weights, zero biases, residual projections scaled by depth."""
    with torch.no_grad():
        if isinstance(m, nn.Linear):
            std = 0.02 / math.sqrt(2 * cfg.layers) if getattr(m, "residual", False) else 0.02
            if not m.weight.is_meta:
                m.weight.normal_(0.0, std)
                if m.bias is not None:
                    m.bias.zero_()
        elif isinstance(m, nn.Embedding) and not m.weight.is_meta:
            m.weight.normal_(0.0, 0.02)


def init_fn(cfg: GPTConfig):
    """For `runtime.Engine(init_fn=...)`: initialize one module as `GPT.__init__` does."""

    def init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            _init(m, cfg)
        elif hasattr(m, "reset_parameters"):
            m.reset_parameters()

    return init
