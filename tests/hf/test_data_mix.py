"""Several data files as one fine-tuning set (hf/data_mix.py): concatenated, or drawn by weight."""

import pytest

from outcore.hf.data_mix import DataFile, FileSamples, data_file, mixed
from outcore.hf.sft_rows import Sample


def samples(tag: int, n: int) -> list[Sample]:
    return [Sample([tag, i], [tag, i]) for i in range(n)]


def test_a_weight_is_read_after_the_last_colon():
    assert data_file("a.jsonl") == DataFile("a.jsonl")
    assert data_file("a.jsonl:0.25") == DataFile("a.jsonl", 0.25)
    assert data_file("dir:x/a.jsonl") == DataFile("dir:x/a.jsonl")  # not a number: part of the path
    with pytest.raises(ValueError, match="a weight is a positive number"):
        data_file("a.jsonl:0")


def test_without_weights_the_files_follow_one_another():
    out, counts = mixed([FileSamples("a", "text", samples(1, 3)), FileSamples("b", "text", samples(2, 2))], seed=0)
    assert [s.input_ids[0] for s in out] == [1, 1, 1, 2, 2] and counts == [3, 2]


def test_weights_draw_each_file_in_its_share_within_sampling_error():
    a, b = FileSamples("a", "text", samples(1, 1000), 3.0), FileSamples("b", "text", samples(2, 1000), 1.0)
    out, counts = mixed([a, b], seed=5)
    assert len(out) == 2000 and sum(counts) == 2000
    share = counts[0] / 2000
    sigma = (0.75 * 0.25 / 2000) ** 0.5
    assert abs(share - 0.75) < 4 * sigma
    assert sum(s.input_ids[0] == 1 for s in out) == counts[0]
    first_thousand = {s.input_ids[1] for s in out if s.input_ids[0] == 1}
    assert len(first_thousand) == 1000  # every sample of a drawn before any repeats (1,500 draws of 1,000)
    again, _ = mixed([a, b], seed=5)
    assert again == out  # seeded


def test_a_file_without_a_weight_beside_weighted_ones_is_refused():
    with pytest.raises(ValueError, match="'b' has no weight"):
        mixed([FileSamples("a", "text", samples(1, 2), 2.0), FileSamples("b", "text", samples(2, 2))], seed=0)
