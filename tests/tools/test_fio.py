import os

import pytest

from outcore.tools.fio import fio_available, fio_mixed_throughput

pytestmark = pytest.mark.skipif(not fio_available(), reason="fio is not installed")


def test_mixed_fio_run_reports_both_directions_and_leaves_only_its_file(tmp_path):
    path = tmp_path / "mixed.bin"
    read, written = fio_mixed_throughput(str(path), size=8 << 20, block_size=1 << 20, queue_depth=2, seconds=1)
    assert read > 0 and written > 0
    assert os.listdir(tmp_path) == ["mixed.bin"]  # the caller removes it (the benchmark does)
