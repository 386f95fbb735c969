"""Fine-tuning data as SFT tools read it: each row format's trained tokens, BOS and EOS once, packing
without cross-talk, and the files the rows come from."""

import json
import os

import pytest
import torch
from trainer_setup import STORY, TEMPLATE, conversations

from outcore.hf.sft_data import dataset_of, sft_dataset
from outcore.hf.sft_rows import IGNORE

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok(model_path):
    return transformers.AutoTokenizer.from_pretrained(model_path)


def bos_tokenizer(directory: str):
    """A tokenizer that adds `<s>` to what it tokenizes, with a template that writes `<s>` itself and
    ends each assistant turn with `</s>`: where a BOS or an EOS is easily doubled."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    t = Tokenizer(models.WordLevel(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    special = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"])
    t.train_from_iterator([STORY + " user assistant :"], special)
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", t.token_to_id("<s>"))])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                               pad_token="</s>")
    tok.chat_template = "<s>" + TEMPLATE
    tok.save_pretrained(directory)
    return transformers.AutoTokenizer.from_pretrained(directory)


def rows(*items):
    return [(f"line {i}", row) for i, row in enumerate(items, 1)]


def trained_text(tok, ds) -> list[str]:
    return [tok.decode([t for t in s.labels if t != IGNORE]) for row in ds.rows for s in row]


CHAT = {"messages": [{"role": "system", "content": "the old man"}, {"role": "user", "content": "the quick fox"},
                     {"role": "assistant", "content": "jumps over"}, {"role": "user", "content": "the lazy dog"},
                     {"role": "assistant", "content": "sleeps near the fire"}]}


@pytest.mark.parametrize("row, expected", [
    (CHAT, "jumps over </s> sleeps near the fire </s>"),
    ({"conversations": [{"from": "human", "value": "the quick fox"}, {"from": "gpt", "value": "jumps over"}]},
     "jumps over </s>"),
    ({"prompt": [{"role": "user", "content": "the quick fox"}], "completion": [{"role": "assistant",
                                                                                 "content": "jumps over"}]},
     "jumps over </s>"),
    ({"instruction": "the quick fox", "input": "the lazy dog", "output": "jumps over"}, "jumps over </s>"),
    ({"prompt": "the quick fox ", "completion": "jumps over"}, "jumps over </s>"),
    ({"text": "the quick fox jumps"}, "the quick fox jumps </s>"),
])
def test_only_what_the_model_should_write_carries_the_loss(tok, row, expected):
    ds = dataset_of(rows(row), "data.jsonl", tok, 64, packing=False)
    assert trained_text(tok, ds) == [expected]
    everything = dataset_of(rows(row), "data.jsonl", tok, 64, packing=False, completion_only=False)
    sample = everything.rows[0][0]
    assert sample.labels == sample.input_ids


def test_alpaca_without_a_template_takes_alpaca_s_own_prompt(tok):
    from outcore.hf.sft_rows import ALPACA_PROMPT

    plain = transformers.AutoTokenizer.from_pretrained(tok.name_or_path)
    plain.chat_template = None
    ds = dataset_of(rows({"instruction": "the quick fox", "output": "jumps over"}), "a.jsonl", plain, 96, packing=False)
    sample = ds.rows[0][0]
    prompt = ALPACA_PROMPT.format(context="", instruction="the quick fox", input="")
    assert sample.input_ids == plain(prompt + "jumps over", add_special_tokens=False).input_ids + [plain.eos_token_id]
    assert trained_text(plain, ds) == ["jumps over </s>"]


def test_bos_and_eos_are_never_doubled(tmp_path):
    tok = bos_tokenizer(str(tmp_path))
    bos, eos = tok.bos_token_id, tok.eos_token_id
    chat = dataset_of(rows(CHAT), "c.jsonl", tok, 64, packing=False).rows[0][0].input_ids
    assert chat[0] == bos and chat[1] != bos and chat.count(bos) == 1  # the template wrote it; none added
    assert chat[-1] == eos and chat[-2] != eos  # the template ended the turn; no EOS added
    text = dataset_of(rows({"text": "the quick fox"}), "t.jsonl", tok, 64, packing=False).rows[0][0].input_ids
    assert text[0] == bos and text.count(bos) == 1 and text[-1] == eos and text.count(eos) == 1
    ended = dataset_of(rows({"text": "the quick fox </s>"}), "t.jsonl", tok, 64, packing=False).rows[0][0].input_ids
    assert ended.count(eos) == 1


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_row_s_summed_loss_is_its_samples_summed_losses_alone(tmp_path, tok, kind, attention):
    from hf_models import save_model

    ds = dataset_of(rows(*conversations(6)), "c.jsonl", tok, 64)
    assert len(ds.rows[0]) > 1  # several samples share the row
    model = transformers.AutoModelForCausalLM.from_pretrained(save_model(kind, str(tmp_path / kind)),
                                                              attn_implementation=attention).eval()

    def summed(ids, labels, positions=None):
        with torch.no_grad():
            logits = model(input_ids=ids[None], position_ids=None if positions is None else positions[None],
                           use_cache=False).logits[0]
        return torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE, reduction="sum")

    row = ds[0]
    packed = summed(row["input_ids"], row["labels"], row["position_ids"])
    alone = sum(summed(torch.tensor(s.input_ids), torch.tensor(s.labels)) for s in ds.rows[0])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=0)
    assert row["position_ids"].tolist()[:3] == [0, 1, 2] and (row["position_ids"] == 0).sum() == len(ds.rows[0])


def test_without_packing_each_sample_has_its_own_padded_row(tok):
    ds = dataset_of(rows(*conversations(3)), "c.jsonl", tok, 64, packing=False)
    assert len(ds) == 3
    row = ds[1]
    n = len(ds.rows[1][0].input_ids)
    assert row["input_ids"].shape == (64,) and (row["labels"][n:] == IGNORE).all()
    assert row["position_ids"].tolist() == list(range(64))


def test_a_sample_longer_than_seq_is_cut_and_counted_and_a_long_text_goes_on_in_pieces(tok):
    long = " ".join(["the"] * 40)
    cut = dataset_of(rows({"prompt": long, "completion": "fox"}, {"prompt": "the ", "completion": "fox"}), "p.jsonl",
                     tok, 16)
    assert cut.counts.truncated == 1 and all(len(s.input_ids) <= 16 for r in cut.rows for s in r)
    text = dataset_of(rows({"text": long}), "t.jsonl", tok, 16)
    pieces = [s for r in text.rows for s in r]
    assert text.counts.truncated == 0 and [len(s.input_ids) for s in pieces] == [16, 16, 9]  # 40 words and EOS


@pytest.mark.parametrize("items, where", [
    ([{"text": "a"}, {"messages": []}], "line 2"),
    ([{"prompt": "a", "completion": "b"}, {"prompt": "c"}], "line 2"),
    ([{"instruction": "a", "output": 3}], "line 1"),
    ([{"question": "a"}], "line 1"),
])
def test_a_mixed_file_or_a_row_missing_its_field_is_refused_naming_the_line(tok, items, where):
    with pytest.raises(ValueError, match=where):
        dataset_of(rows(*items), "d.jsonl", tok, 64)


def test_every_file_kind_reads_the_same_rows(tmp_path, tok):
    import datasets

    data = [{"prompt": "the quick fox ", "completion": "jumps over"}, {"prompt": "the lazy ", "completion": "dog"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    (tmp_path / "d.json").write_text(json.dumps(data))
    datasets.Dataset.from_list(data).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_list(data).save_to_disk(str(tmp_path / "saved"))
    got = [trained_text(tok, sft_dataset(str(tmp_path / name), tok, 32, packing=False))
           for name in ("d.jsonl", "d.json", "d.parquet", "saved")]
    assert got[0] == ["jumps over </s>", "dog </s>"] and all(g == got[0] for g in got)
    (tmp_path / "d.txt").write_text("the quick fox")
    assert trained_text(tok, sft_dataset(str(tmp_path / "d.txt"), tok, 32)) == ["the quick fox </s>"]
    with pytest.raises(ValueError, match="d.csv"):
        sft_dataset(str(tmp_path / "d.csv"), tok, 32)
    assert os.path.exists(tmp_path / "saved")
