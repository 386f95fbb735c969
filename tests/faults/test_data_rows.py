"""Round 3, the rows a fine-tune reads: a sample with no token or no trained token within --seq is
dropped and counted (never packed, never "diverged"), a file where none remains is refused before
step 1; decoding, nesting and size errors name the file and line and quote at most 200 characters;
a FIFO is named for what it is; template rendering is bounded; a huge row costs a small multiple
of its size."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "hf"))
from trainer_setup import STORY, TEMPLATE, model_dir  # noqa: E402

import outcore.hf.sft_rows as sft_rows  # noqa: E402
from outcore.hf.data_files import read_rows  # noqa: E402
from outcore.hf.sft_data import dataset_of, samples_of  # noqa: E402
from outcore.hf.sft_rows import IGNORE  # noqa: E402
from outcore.tools.cli import main  # noqa: E402

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return model_dir(str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def tok(model_path):
    return transformers.AutoTokenizer.from_pretrained(model_path)


def _rows(*items):
    return [(f"line {i}", row) for i, row in enumerate(items, 1)]


LONG_PROMPT = {"prompt": " ".join(STORY.split() * 4), "completion": " the end"}
SHORT = {"prompt": "the quick fox", "completion": " jumps over"}


def test_rows_whose_trained_tokens_are_all_cut_are_dropped_and_counted(tok, caplog):
    ds = dataset_of(_rows(SHORT, LONG_PROMPT, SHORT), "d.jsonl", tok, 16)
    assert ds.counts.samples == 2 and ds.counts.dropped == 1
    assert "1 of 3 rows left out (1: no trained token within --seq 16)" in caplog.text
    assert all(any(label != IGNORE for label in ds[i]["labels"].tolist()) for i in range(len(ds)))


def test_a_file_none_of_whose_rows_trains_is_refused_before_step_1(tmp_path, model_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(LONG_PROMPT) + "\n" for _ in range(6)))
    assert main(["train", "--model", model_path, "--data", str(data), "--seq", "16", "--steps", "2",
                 "--out", str(tmp_path / "run"), "--offload-params", "none", "--offload-optimizer", "none"]) == 2
    said = capsys.readouterr()
    assert "none of its 6 rows can be trained on (6: no trained token within --seq 16)" in said.err
    assert "step 1" not in said.out and "nan" not in said.err


def test_a_sample_with_no_tokens_is_dropped_not_packed(tok):
    empty = "{% for m in messages %}{% if m['content'] != 'nothing' %}{{ m['content'] }} {% endif %}{% endfor %}"
    rows = _rows({"messages": [{"role": "user", "content": "nothing"}]},
                 {"messages": [{"role": "user", "content": "the quick fox"}]})
    samples, _, _, dropped = samples_of(rows, "d.jsonl", tok, 16, completion_only=False, chat_template=empty)
    assert dropped == 1 and len(samples) == 1 and samples[0].input_ids


def test_json_nested_too_deep_names_the_file_and_line(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    jsonl = tmp_path / "deep.jsonl"
    jsonl.write_text(json.dumps({"text": "a"}) + "\n" + deep + "\n")
    with pytest.raises(ValueError, match=r"deep.jsonl' line 2 nests JSON deeper"):
        read_rows(str(jsonl))
    whole = tmp_path / "deep.json"
    whole.write_text('[{"text": "a"},\n' + deep + "]")
    with pytest.raises(ValueError, match=r"deep.json' line 2 nests JSON deeper"):
        read_rows(str(whole))


def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path, model_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"text": "a"}\n{"text": "b"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl' line 3 is not UTF-8"):
        read_rows(str(data))
    text = tmp_path / "d.txt"
    text.write_bytes(b"one\ntwo\nthr\xffee\n")
    with pytest.raises(ValueError, match=r"d.txt' line 3 is not UTF-8"):
        read_rows(str(text))
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                             {"role": "assistant", "content": "b"}]}) + "\n")
    template = tmp_path / "t.jinja"
    template.write_bytes(TEMPLATE.encode() + b"\n\xc3(")
    assert main(["train", "--model", model_path, "--data", str(good), "--chat-template", str(template),
                 "--out", str(tmp_path / "run")]) == 2
    assert "--chat-template" in capsys.readouterr().err


def test_a_rejected_huge_row_is_quoted_to_200_characters(tok):
    turn = {"from": "narrator", "value": "x" * 900_000}  # (a row over 1 MB is left out before it is read)
    with pytest.raises(ValueError) as e:
        samples_of(_rows({"conversations": [turn]}), "d.jsonl", tok, 16)
    assert "narrator" in str(e.value) and len(str(e.value)) < 600


def test_a_fifo_is_named_for_what_it_is(tmp_path):
    fifo = tmp_path / "d.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is not a regular file"):
        read_rows(str(fifo))


def test_a_template_that_loops_too_long_is_stopped_and_says_so(tok, monkeypatch):
    monkeypatch.setattr(sft_rows, "TEMPLATE_SECONDS", 0.5)
    slow = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
            "{{ messages[0]['content'] }}")
    with pytest.raises(ValueError, match="ran for more than 0 s"):
        samples_of(_rows({"messages": [{"role": "user", "content": "a"}]}), "d.jsonl", tok, 16,
                   completion_only=False, chat_template=slow)


@pytest.mark.slow
def test_a_huge_text_row_costs_a_small_multiple_of_its_size(tmp_path, model_path):
    """A 8 MB line (the tokenizer alone takes ~100x a text it tokenizes whole)."""
    words = STORY.split()
    data = tmp_path / "big.jsonl"
    data.write_text(json.dumps({"text": " ".join(words[i % len(words)] for i in range(1_600_000))}) + "\n")
    size = os.path.getsize(data)
    script = (
        "import sys, transformers\n"
        "from outcore.hf.data_files import read_rows\n"
        "from outcore.hf.sft_data import samples_of\n"
        "def peak(): return int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) * 1024\n"
        f"tok = transformers.AutoTokenizer.from_pretrained({model_path!r})\n"
        "tok('warm the tokenizer up')\n"
        "before = peak()\n"
        f"samples = samples_of(read_rows({str(data)!r}), 'big', tok, 64)[0]\n"
        "print(peak() - before, sum(len(s.input_ids) for s in samples))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    grown, tokens = map(int, out.stdout.split())
    assert tokens >= 1_600_000
    assert grown < 10 * size, (grown, size)  # whole, the tokenizer alone took 120x
