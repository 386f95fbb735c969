"""The byte corpus: windows read from disk match the concatenated text; splits are disjoint."""

import json
import os

import pytest
import torch

from outcore.tools.corpus import ByteCorpus, Segment, batch_generator, file_corpus, stdlib_corpus, stdlib_sources


def test_windows_spanning_files_read_the_concatenated_bytes(tmp_path):
    texts = [b"alpha\n" * 3, b"", b"beta-beta\n", b"gamma" * 7]
    segs = []
    for i, t in enumerate(texts):
        p = tmp_path / f"f{i}.txt"
        p.write_bytes(b"HEADER" + t)  # segments may start inside a file
        segs.append(Segment(str(p), 6, len(t)))
    corpus = ByteCorpus(segs, "test")
    whole = b"".join(texts)
    assert corpus.nbytes == len(whole)
    for start in range(len(whole) - 12):
        assert corpus.read(start, 12) == whole[start : start + 12]
    x, y = corpus.batch(16, 9, batch_generator(3, 7, "train"))
    assert x.shape == y.shape == (16, 9) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    for row in torch.cat([x, y[:, -1:]], 1).tolist():
        assert bytes(row) in whole


def test_batches_depend_only_on_seed_step_and_split(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("".join(f"line {i}\n" for i in range(2000)))
    train, held = file_corpus(str(p))
    a = train.batch(4, 32, batch_generator(0, 5, "train"))
    b = train.batch(4, 32, batch_generator(0, 5, "train"))
    c = train.batch(4, 32, batch_generator(0, 6, "train"))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    assert train.nbytes + held.nbytes == os.path.getsize(p) and held.nbytes == int(os.path.getsize(p) * 0.05)


def test_stdlib_corpus_holds_out_whole_files():
    files = stdlib_sources()
    assert len(files) > 100 and all(f.endswith(".py") and "site-packages" not in f for f in files)
    train, held = stdlib_corpus()
    train_files = {s.path for s in train.segments}
    held_files = {s.path for s in held.segments}
    assert not train_files & held_files and len(held_files) >= len(files) // 20 - 1
    assert train.nbytes > 10 * held.nbytes > 0


def test_bad_data_files_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="missing.txt"):
        file_corpus(str(tmp_path / "missing.txt"))
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 100)
    with pytest.raises(ValueError, match="not UTF-8"):
        file_corpus(str(binary))
    short = tmp_path / "short.txt"
    short.write_text("too short")
    train, _ = file_corpus(str(short))
    with pytest.raises(ValueError, match="shorter --seq"):
        train.batch(2, 64, batch_generator(0, 0, "train"))


def test_a_jsonl_file_trains_on_its_rows_texts_not_its_json(tmp_path):
    rows = [f"document {i}: " + "the lazy dog sleeps. " * 20 for i in range(40)]
    p = tmp_path / "docs.jsonl"
    p.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(rows)))
    train, held = file_corpus(str(p))
    joined = "\n\n".join(rows).encode()
    assert train.read(0, train.nbytes) + held.read(0, held.nbytes) == joined
    x, y = train.batch(8, 64, batch_generator(0, 0, "train"))
    for row in torch.cat([x, y[:, -1:]], 1).tolist():
        assert bytes(row) in joined and b'"text"' not in bytes(row)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"line 2 has neither a \"text\" string nor a \"messages\" list"):
        file_corpus(str(tmp_path / "bad.jsonl"))
