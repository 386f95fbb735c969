"""One fine-tuning row as the tokens a model trains on, and which of them carry its loss: what TRL's
SFTTrainer, axolotl and LlamaFactory do with the same row.

Formats, detected from a row's fields (every row of a file in one format):
- text: `{"text"}`, trained on every token;
- conversational: `{"messages": [{"role", "content"}, ...]}`, rendered by the chat template;
- prompt-completion: `{"prompt", "completion"}`, strings (joined as they are) or message lists
  (TRL's conversational prompt-completion: the prompt rendered with the generation prompt);
- Alpaca: `{"instruction", "input"?, "output"}`, as a conversation when the tokenizer has a chat
  template, else in Alpaca's own prompt (`ALPACA_PROMPT`);
- ShareGPT: `{"conversations": [{"from", "value"}, ...]}`, as a conversation (human → user, gpt →
  assistant).

Labels: by default only what the model should learn to write carries the loss: each assistant
turn (as the template renders it, its end-of-turn token included), the completion, Alpaca's
output; every other position is -100. The row is rendered to text whole, and the character spans
of those parts are found by rendering its prefixes (the conversation before an assistant turn,
with the generation prompt; the conversation through that turn); the text is then tokenized once
and a token carries the loss when it overlaps a span. With `completion_only=False` every token does.

Special tokens: the text is tokenized without adding any; a BOS is put first where the tokenizer
adds one and the text does not already begin with it (a chat template often writes it), so never
twice. Rows without a template (text, plain prompt-completion, Alpaca's prompt) end with the EOS
token, trained, unless they end with it already; a template ends its turns itself.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from outcore.hf.data_files import Row, quoted

log = logging.getLogger(__name__)

IGNORE = -100  # the label of a position that carries no loss, as transformers' losses skip it
ALPACA_PROMPT = ("Below is an instruction that describes a task{context}. Write a response that appropriately "
                 "completes the request.\n\n### Instruction:\n{instruction}\n\n{input}### Response:\n")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "system": "system"}
FORMATS = {  # name: (the fields that say it, how the log calls it)
    "messages": (("messages",), "conversational rows (messages)"),
    "sharegpt": (("conversations",), "ShareGPT rows (conversations)"),
    "prompt-completion": (("prompt", "completion"), "prompt-completion rows"),
    "alpaca": (("instruction", "output"), "Alpaca rows (instruction, input, output)"),
    "text": (("text",), "text rows"),
}


TEMPLATE_SECONDS = 10.0  # the longest one rendering of a chat template may take
TEXT_PIECE = 1 << 18  # characters of a long text row tokenized at a time (the tokenizer takes ~100x)


@dataclass(frozen=True)
class Sample:
    input_ids: Sequence[int]
    labels: Sequence[int]  # IGNORE where the position carries no loss

    @property
    def trains(self) -> bool:
        """Whether a token of it carries the loss (its first never does: nothing before predicts it)."""
        return any(label != IGNORE for label in self.labels[1:])


class TemplateTimeout(Exception):
    """A chat template rendering ran past TEMPLATE_SECONDS."""


def detect_format(rows: list[Row], path: str) -> str:
    """The one format of every row of `path`; ValueError naming the first row that has another, or none."""
    found = None
    for where, row in rows:
        fmt = next((name for name, (fields, _) in FORMATS.items() if all(f in row for f in fields)), None)
        if fmt is None:
            raise ValueError(f"{path!r} {where} has the fields {quoted(sorted(row))}, which are none of the formats: "
                             + "; ".join("+".join(fields) for fields, _ in FORMATS.values()) + ".")
        if found is not None and fmt != found[0]:
            raise ValueError(f"{path!r} {where} is a {fmt} row, but {found[1]} is a {found[0]} row: a file holds "
                             "rows of one format; split it.")
        found = found or (fmt, where)
    if found is None:
        raise ValueError(f"{path!r} holds no rows.")
    return found[0]


class RowTokenizer:
    """`sample(row)`: a row of one format as a `Sample`, by this tokenizer and chat template."""

    def __init__(self, tokenizer: Any, fmt: str, path: str, *, completion_only: bool = True,
                 chat_template: str | None = None) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"{type(tokenizer).__name__} is a slow tokenizer; outcore finds the trained tokens by "
                             "their character offsets, which fast tokenizers give: save the model's tokenizer as "
                             "tokenizer.json (AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained).")
        self.tokenizer, self.fmt, self.path = tokenizer, fmt, path
        self.completion_only = completion_only
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        templated = fmt in ("messages", "sharegpt") or (fmt == "alpaca" and self.template)
        if templated and not self.template:
            raise ValueError(f"{path!r} holds {FORMATS[fmt][1]}, and the tokenizer has no chat template to render "
                             "them: give --chat-template FILE (a Jinja template), or rows of \"text\".")
        bos = tokenizer.bos_token_id
        self.bos = bos if bos is not None and tokenizer("a").input_ids[:1] == [bos] else None
        self.eos = tokenizer.eos_token_id

    def sample(self, where: str, row: dict[str, Any]) -> Sample:
        text, spans, templated = self._text_and_spans(where, row)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(encoded.input_ids), list(encoded.offset_mapping)
        trained = [not self.completion_only or any(s < end and e > start for start, end in spans)
                   for s, e in offsets]
        if not templated and self.eos is not None and ids[-1:] != [self.eos]:
            ids.append(self.eos)  # the end of the row, learned with the completion
            trained.append(not self.completion_only or bool(spans and spans[-1][1] == len(text)))
        if self.bos is not None and ids[:1] != [self.bos]:
            ids.insert(0, self.bos)
            trained.insert(0, not self.completion_only)
        return Sample(ids, [i if t else IGNORE for i, t in zip(ids, trained, strict=True)])

    # -- each format's text and the spans that carry the loss ---------------------------------------

    def _text_and_spans(self, where: str, row: dict[str, Any]) -> tuple[str, list[tuple[int, int]], bool]:
        if self.fmt == "text":
            text = _string(row, "text", self.path, where)
            return text, [(0, len(text))], False
        if self.fmt == "prompt-completion":
            prompt, completion = row["prompt"], row["completion"]
            if isinstance(prompt, list) and isinstance(completion, list):
                messages = [*_messages(prompt, self.path, where), *_messages(completion, self.path, where)]
                before = self._render(messages[:len(prompt)], where, generation_prompt=True)
                text = self._render(messages, where)
                return text, [(self._prefix(before, text, where), len(text))], True
            prompt, completion = _string(row, "prompt", self.path, where), _string(row, "completion", self.path, where)
            return prompt + completion, [(len(prompt), len(prompt) + len(completion))], False
        if self.fmt == "alpaca":
            instruction = _string(row, "instruction", self.path, where)
            output = _string(row, "output", self.path, where)
            context = row.get("input") or ""
            if not isinstance(context, str):
                raise ValueError(f"{self.path!r} {where}: \"input\" is a {type(context).__name__}, not a string.")
            if self.template:
                request = instruction + (f"\n\n{context}" if context else "")
                return self._conversation([{"role": "user", "content": request},
                                           {"role": "assistant", "content": output}], where)
            prompt = ALPACA_PROMPT.format(context=", paired with an input that provides further context" if context
                                          else "", instruction=instruction,
                                          input=f"### Input:\n{context}\n\n" if context else "")
            return prompt + output, [(len(prompt), len(prompt) + len(output))], False
        if self.fmt == "sharegpt":
            turns = row["conversations"]
            if not isinstance(turns, list):
                raise ValueError(f"{self.path!r} {where}: \"conversations\" is not a list of turns.")
            messages = []
            for turn in turns:
                role = SHAREGPT_ROLES.get(str(turn.get("from"))) if isinstance(turn, dict) else None
                if role is None or not isinstance(turn.get("value"), str):
                    raise ValueError(f"{self.path!r} {where}: a ShareGPT turn is {{\"from\": one of "
                                     f"{sorted(SHAREGPT_ROLES)}, \"value\": a string}}; got {quoted(turn)}.")
                messages.append({"role": role, "content": turn["value"]})
            return self._conversation(messages, where)
        return self._conversation(_messages(row["messages"], self.path, where), where)

    def _conversation(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]], bool]:
        """The rendered conversation and the span of each assistant turn in it."""
        text = self._render(messages, where)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                before = self._render(messages[:i], where, generation_prompt=True) if i else ""
                through = self._render(messages[: i + 1], where)
                spans.append((self._prefix(before, text, where), self._prefix(through, text, where)))
        if not spans and self.completion_only:
            raise ValueError(f"{self.path!r} {where} has no assistant turn, so nothing to learn from it: give it "
                             "one, or train on every token with --train-on-prompt.")
        return text, spans, True

    def _render(self, messages: list[dict], where: str, *, generation_prompt: bool = False) -> str:
        try:
            with _bounded(TEMPLATE_SECONDS):
                return self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=self.template,
                                                          add_generation_prompt=generation_prompt)
        except TemplateTimeout:
            raise ValueError(f"{self.path!r} {where}: the chat template ran for more than {TEMPLATE_SECONDS:.0f} s "
                             "rendering this conversation, and was stopped: its loops run too long; fix the "
                             "template (--chat-template FILE).") from None
        except Exception as e:  # noqa: BLE001 - a template raises what its Jinja code raises
            raise ValueError(f"{self.path!r} {where}: the chat template does not render this conversation "
                             f"({type(e).__name__}: {quoted(str(e))}).") from e

    def text_pieces(self, where: str, text: str, seq: int) -> Iterator[Sample]:
        """A text row too long to tokenize whole (a tokenizer takes about a hundred times a text's
        size while it works) as samples of `seq` tokens, every token trained: tokenized TEXT_PIECE
        characters at a time, each piece cut after a line break (else a space) so that no word is
        split; said once, since a cut may tokenize differently than the whole text would."""
        log.warning("%s %s is %.1f MB of text: tokenized %d KB at a time, each piece cut at a line break", self.path,
                    where, len(text) / 1e6, TEXT_PIECE >> 10)
        ids = array("i")
        start = 0
        while start < len(text):
            end = _cut(text, start, TEXT_PIECE)
            ids.extend(self.tokenizer(text[start:end], add_special_tokens=False, return_attention_mask=False)
                       ["input_ids"])
            if start == 0 and self.bos is not None and ids[:1] != array("i", [self.bos]):
                ids.insert(0, self.bos)
            start = end
            while len(ids) >= seq:
                piece = ids[:seq]
                yield Sample(piece, piece)
                del ids[:seq]
        if self.eos is not None and ids[-1:] != array("i", [self.eos]):
            ids.append(self.eos)
        if len(ids) >= 2:
            yield Sample(ids, ids)

    def _prefix(self, part: str, text: str, where: str) -> int:
        """Where `part`, a rendering of the conversation's beginning, ends in `text`."""
        if not text.startswith(part):
            raise ValueError(f"{self.path!r} {where}: the chat template renders a conversation's first turns "
                             "differently alone than followed by the rest, so its assistant turns cannot be told "
                             "apart; train on every token (--train-on-prompt), or give a template that renders "
                             "turns one after another (--chat-template FILE).")
        return len(part)


def _string(row: dict[str, Any], field: str, path: str, where: str) -> str:
    value = row.get(field)
    if not isinstance(value, str):
        what = "missing" if value is None else f"a {type(value).__name__}"
        raise ValueError(f"{path!r} {where}: \"{field}\" is {what}, not a string.")
    return value


def _messages(value: Any, path: str, where: str) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                              and isinstance(m.get("content"), str) for m in value):
        raise ValueError(f"{path!r} {where}: messages are a list of {{\"role\": ..., \"content\": a string}}.")
    return value


def _cut(text: str, start: int, size: int) -> int:
    """Where a piece of about `size` characters from `start` ends: after its last line break in its
    second half, else after its last space there, else at `size`."""
    end = start + size
    if end >= len(text):
        return len(text)
    for mark in ("\n", " "):
        at = text.rfind(mark, start + size // 2, end)
        if at >= 0:
            return at + 1
    return end


@contextlib.contextmanager
def _bounded(seconds: float) -> Iterator[None]:
    """TemplateTimeout in the block after `seconds`, by SIGALRM: on the main thread only (elsewhere
    unbounded), and the timer and handler that were there put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_signum: int, _frame: Any) -> None:
        raise TemplateTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    left = signal.setitimer(signal.ITIMER_REAL, seconds)[0]
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if left:
            signal.setitimer(signal.ITIMER_REAL, left)
