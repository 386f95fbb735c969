"""A tiny Llama and its tokenizer, built here from a config (nothing downloaded), so that each example
runs offline on a CPU in seconds. Pass `--model /models/your-model` to an example to use your own.

    from tiny_model import tiny_llama, WORDS
    directory = tiny_llama("tiny-llama")   # config.json, model.safetensors, a word-level tokenizer
"""

import os

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
