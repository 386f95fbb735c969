"""A tiny Llama and its tokenizer, built here from a config (nothing downloaded), and rows of each data
format over its words, so that each example runs offline on a CPU in seconds. Pass `--model
/models/your-model` (and `--data`) to an example to use your own.

    from tiny_model import tiny_llama, chats, write_jsonl
    directory = tiny_llama("tiny-llama")   # config.json, model.safetensors, a word-level tokenizer
    write_jsonl("chats.jsonl", chats(32))
"""

import json
import os
import random

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

WORDS = ("the quick brown fox jumps over the lazy dog while the small cat sleeps near the warm fire and the old "
         "man reads a long book about the sea good bad yes no user assistant").split()
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {% if m['role'] == 'assistant' %}{% generation %}"
                 "{{ m['content'] }} </s>{% endgeneration %}{% else %}{{ m['content'] }} {% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}assistant : {% endif %}")


def tiny_llama(directory: str) -> str:
    """A randomly initialized 2-layer Llama of width 64 with a word-level tokenizer and a chat
    template, saved in `directory` (made once; an existing one is reused)."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS) + " :"], trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>",
                                                     pad_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      eos_token_id=1, pad_token_id=1, bos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _words(rnd: random.Random, k: int) -> str:
    return " ".join(rnd.choices(WORDS, k=k))


def chats(n: int) -> list[dict]:
    """Conversational rows: {"messages": [a user turn, an assistant turn]}."""
    rnd = random.Random(0)
    return [{"messages": [{"role": "user", "content": _words(rnd, 5)},
                          {"role": "assistant", "content": _words(rnd, 4)}]} for _ in range(n)]


def notes(n: int) -> list[dict]:
    """Text rows: {"text"}."""
    rnd = random.Random(0)
    return [{"text": _words(rnd, 12)} for _ in range(n)]


def preferences(n: int) -> list[dict]:
    """Preference rows: {"prompt", "chosen", "rejected"}, the chosen saying "good", the rejected "bad"."""
    rnd = random.Random(0)
    return [{"prompt": _words(rnd, 5), "chosen": " good " * 2, "rejected": " bad " * 2} for _ in range(n)]


def prompts(n: int) -> list[dict]:
    """Prompt rows: {"prompt"}, for a trainer that writes the completions itself (GRPO)."""
    rnd = random.Random(0)
    return [{"prompt": _words(rnd, 4)} for _ in range(n)]


def write_jsonl(path: str, rows: list[dict]) -> str:
    """`rows` as a JSONL file at `path`; returns the path."""
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path
