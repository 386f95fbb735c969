"""The command line's sizes and counts, read and written."""

import subprocess
import sys

import pytest

from outcore.runtime.sizes import human_bytes, human_count, parse_count, parse_size


@pytest.mark.parametrize(("n", "text"), [(0, "0"), (7, "7"), (999, "999"), (1000, "1K"), (842_496, "842K"),
                                         (999_600, "1M"), (14_500_000, "14.5M"), (134_217_728, "134M"),
                                         (1_300_000_000, "1.3B"), (13e9, "13B"), (2.5e15, "2500T")])
def test_a_count_is_written_to_three_significant_digits_in_the_unit_parse_count_reads(n, text):
    assert human_count(n) == text
    if 0 < n <= 1e15:
        assert parse_count(text) == pytest.approx(n, rel=5e-3)  # read back, to the digits written


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "1e400"])
def test_a_count_or_size_that_is_not_finite_is_refused_as_such(text):
    with pytest.raises(ValueError, match="is not a count"):
        parse_count(text)
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


def test_a_count_beyond_any_model_is_refused_naming_the_most_accepted():
    assert parse_count("1000T") == 10**15
    with pytest.raises(ValueError, match="at most 1000T"):
        parse_count("1e30")


@pytest.mark.slow  # spawns a process
@pytest.mark.parametrize(("argv", "names"), [(["estimate", "--params", "inf"], "--params 'inf'"),
                                             (["train", "--host-budget", "inf"], "--host-budget 'inf'"),
                                             (["train", "--seed", str(2**70)], f"--seed '{2**70}'")])
def test_the_command_line_answers_a_number_out_of_range_with_one_line_and_status_2(argv, names):
    run = subprocess.run([sys.executable, "-m", "outcore.tools.cli", *argv], capture_output=True, text=True)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr and names in run.stderr.replace(":", "")


def test_sizes_past_a_tebibyte_are_written_in_their_own_units():
    assert human_bytes(3 << 50) == "3.0 PiB" and human_bytes(5 << 60) == "5.0 EiB"
