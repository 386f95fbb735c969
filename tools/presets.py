"""GPT shapes by name: the presets of `outcore train`, `estimate` and `tune`.

Plain data, no torch: the command line lists them without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass


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
