"""outcore's own GPT: a pre-norm transformer with learned positions and (optionally) tied embeddings.

Small whole file, read top to bottom: attention → block → model (shapes live in tools/presets.py).
Every module has `reset_parameters`, so the model can be built under `runtime.deferred_init()` and
materialized unit by unit.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from outcore.tools.presets import PRESETS, GPTConfig

__all__ = ["GPT", "PRESETS", "GPTConfig", "init_fn"]



class ResidualLinear(nn.Linear):
    """A projection that feeds the residual stream: initialized smaller, by depth (see `_init`)."""

class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = ResidualLinear(cfg.d_model, cfg.d_model)

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
        self.out = ResidualLinear(4 * cfg.d_model, cfg.d_model)

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
            std = 0.02 / math.sqrt(2 * cfg.layers) if isinstance(m, ResidualLinear) else 0.02
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
        elif callable(reset := getattr(m, "reset_parameters", None)):
            reset()

    return init
