"""The peak RSS the tools report is the process's own, even in a child of a large parent."""

import subprocess
import sys

import pytest

from outcore.tools.report import peak_rss

CHILD = "from outcore.tools.report import peak_rss; print(peak_rss())"


@pytest.mark.slow  # spawns a process
def test_a_child_of_a_large_parent_reports_its_own_peak():
    held = bytearray(768 << 20)
    held[:: 4096] = b"x" * len(held[:: 4096])  # every page touched: resident in this process
    parent = peak_rss()
    child = int(subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout)
    del held
    assert parent >= 768 << 20
    assert child < parent - (512 << 20), (child, parent)  # getrusage's ru_maxrss would give the parent's
