import json
import shutil
import subprocess
import sys

import pytest

from outcore.tools.arg_types import parse_list, parse_size
from outcore.tools.bench_disk import bench_disk
from outcore.tools.cli import main


def test_sizes_parse_as_binary_multiples():
    assert parse_size("4G") == 4 << 30 and parse_size("128K") == 128 << 10 and parse_size("4096") == 4096
    assert parse_list("128K,1M", parse_size) == [128 << 10, 1 << 20]
    with pytest.raises(ValueError, match="not a size"):
        parse_size("4 potatoes")


def test_bench_disk_measures_every_setting_and_marks_the_best(tmp_path):
    res = bench_disk(str(tmp_path), size=2 << 20, block_sizes=[64 << 10, 1 << 20], queue_depths=[1, 4],
                     threads=[2], backends=["threads", "aiofiles"], repeats=1, use_fio=False)
    assert len(res["results"]) == 8
    assert all(r["write_MBps"] > 0 and r["read_MBps"] > 0 and r["direct_used"] for r in res["results"])
    best = res["results"][res["best_read"]]
    assert best["read_MBps"] == max(r["read_MBps"] for r in res["results"])
    assert list(tmp_path.iterdir()) == [], "the bench file is removed"


def test_cli_writes_json_and_a_table(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench-disk", "--dir", str(tmp_path), "--size", "1M", "--block-size", "256K", "--queue-depth", "2",
               "--threads", "1", "--backend", "threads", "--no-fio", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "write MB/s" in printed and "*" in printed
    data = json.loads(out.read_text())
    assert data["results"][0]["block_size"] == 256 << 10 and data["size"] == 1 << 20


def test_a_missing_dir_is_created(tmp_path):
    assert main(["bench-disk", "--dir", str(tmp_path / "new" / "disk"), "--size", "256K", "--block-size", "128K",
                 "--queue-depth", "1", "--threads", "1", "--backend", "threads", "--no-fio"]) == 0
    assert (tmp_path / "new" / "disk").is_dir()


def test_a_dir_that_cannot_be_made_exits_2(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["bench-disk", "--dir", str(tmp_path / "file" / "x"), "--size", "8M"]) == 2
    assert "cannot be created: Not a directory" in capsys.readouterr().err
    assert main(["bench-disk", "--dir", str(tmp_path / "file"), "--size", "8M"]) == 2
    assert "is a file" in capsys.readouterr().err


def test_a_size_beyond_the_free_space_exits_2_before_writing(tmp_path, capsys):
    size = shutil.disk_usage(tmp_path).free + (1 << 30)
    assert main(["bench-disk", "--dir", str(tmp_path), "--size", str(size), "--no-fio"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--size {size:,} bytes does not fit" in err and "free" in err and "\n" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["bench-disk", "--dir", ".", "--size", "1M", "--block-size", "1000"], "multiple of 4096"),
    (["bench-disk", "--dir", ".", "--size", "4K", "--block-size", "1M"], "smaller than the largest block"),
])
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_a_size_that_does_not_parse_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench-disk", "--dir", ".", "--size", "lots"])
    assert e.value.code == 2


@pytest.mark.slow  # spawns a process
def test_bench_disk_does_not_import_torch():
    code = "import sys, outcore.tools.cli, outcore.tools.bench_disk; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", "bench-disk's memory bound leaves no room for torch's ~200 MB"
