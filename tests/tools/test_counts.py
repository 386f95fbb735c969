"""The command line's sizes and counts, read and written."""

import pytest

from outcore.tools.units import human_count, parse_count


@pytest.mark.parametrize(("n", "text"), [(0, "0"), (7, "7"), (999, "999"), (1000, "1K"), (842_496, "842K"),
                                         (999_600, "1M"), (14_500_000, "14.5M"), (134_217_728, "134M"),
                                         (1_300_000_000, "1.3B"), (13e9, "13B"), (2.5e15, "2500T")])
def test_a_count_is_written_to_three_significant_digits_in_the_unit_parse_count_reads(n, text):
    assert human_count(n) == text
    if n:
        assert parse_count(text) == pytest.approx(n, rel=5e-3)  # read back, to the digits written
