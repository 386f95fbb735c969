"""Tiny Hugging Face causal LMs made from configs and saved locally (no download), for the tests."""

from __future__ import annotations

import os

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    FalconConfig,
    Gemma2Config,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OPTConfig,
    Phi3Config,
    Qwen2Config,
)

import outcore

VOCAB = 96


def config(kind: str, *, dropout: float = 0.0) -> transformers.PretrainedConfig:
    """A tiny config of `kind`; `dropout` is OPT's (the others train without any, for parity)."""
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "llama-tied":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if kind == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if kind == "qwen2":
        return Qwen2Config(**common)
    if kind == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                          eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: parity
    # transformers converts these two on load (their save_pretrained writes the stored form back):
    # GPT-NeoX's head is stored as `embed_out`, Mixtral's experts one by one, not stacked per layer
    if kind == "gpt_neox":
        return GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=64, hidden_dropout=0.0,
                             attention_dropout=0.0)
    if kind == "mixtral":
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    # Other layouts of a decoder: a sliding window, soft-capped logits and tied embeddings, a fused
    # qkv projection, learned positions (OPT's offset by 2), ALiBi instead of rotary tables
    if kind == "mistral":
        return MistralConfig(**common, sliding_window=8)
    if kind == "gemma2":
        return Gemma2Config(**common, head_dim=8)
    if kind == "phi3":
        return Phi3Config(**common, pad_token_id=0)
    if kind == "opt":
        return OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=64, word_embed_proj_dim=32, dropout=dropout)
    if kind == "falcon":
        return FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            new_decoder_architecture=True, num_kv_heads=2)
    if kind == "bloom":
        return BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    raise ValueError(kind)


def save_model(kind: str, directory: str, *, dropout: float = 0.0, **save_kw) -> str:
    """A randomly initialized model of `kind`, saved with `save_pretrained`; returns the directory."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config(kind, dropout=dropout)).save_pretrained(directory, **save_kw)
    return directory


def deferred(directory: str) -> torch.nn.Module:
    """The model of `directory` built under deferred_init(): parameters on the meta device."""
    with outcore.deferred_init():
        return AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))


def token_batches(n: int, batch: int = 2, seq: int = 12, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def files(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


STORY = ("the quick brown fox jumps over the lazy dog while the small cat sleeps near the warm fire and "
         "the old man reads a long book about the sea ")


def save_tokenizer(directory: str, text: str = STORY) -> None:
    """A word-level tokenizer trained here on `text` (no download), saved beside the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    assert tok.get_vocab_size() <= VOCAB
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(directory)
