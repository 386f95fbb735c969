"""Round 2's small ones: a prefetch depth past any use is a config error, not an OSError mid-run; a
tag that would not read back as itself (whitespace, a control character) is refused; budgets past
the address-space limit; an nvme_dir on a filesystem that reports no size (ramfs); an export onto a
full disk."""

import os
import subprocess
import sys

import pytest
import torch

import outcore
from outcore.runtime.checkpoint.folder import is_tag
from outcore.tools.cli import main


def test_a_prefetch_depth_past_any_use_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(ValueError, match="prefetch_depth=1000000000: must be between 0 and 1024"):
        outcore.Config(prefetch_depth=10**9)
    assert main(["train", "--steps", "1", "--prefetch-depth", "1000000000", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prefetch_depth" in err[0] and not (tmp_path / "run").exists()


@pytest.mark.parametrize("tag", ["c\n", " c2", "c2 ", "a\tb", ".hidden", "a/b", ""])
def test_a_tag_that_would_not_read_back_as_itself_is_refused(tmp_path, tag):
    assert not is_tag(tag)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    engine = outcore.Engine(model, outcore.Config(), outcore.AdamW(lr=1e-3))
    with pytest.raises(ValueError, match="use a plain name"):
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag=tag)
    engine.close()
    assert is_tag("step100") and is_tag("best-2026_12_06")


ADDRESS_SPACE = """
import logging, resource, sys
import torch, outcore
from outcore.offload import StorageError, TieredStore
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
size = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (size + (3 << 30), resource.RLIM_INFINITY))
store = TieredStore(sys.argv[1], "cpu", 1 << 30, 1 << 30)  # its arena: 4 GiB of address space wanted, 2 fit
store.put("k", torch.ones(1000))
assert torch.equal(store.fetch_now("k"), torch.ones(1000))
store.release("k")
store.close()
print("fits")
try:
    outcore.Engine(torch.nn.Linear(4, 4), outcore.Config(host_budget=2 << 30, device_budget=2 << 30))
except StorageError as e:
    print("refused:", e)
"""


@pytest.mark.slow
def test_budgets_past_the_address_space_limit(tmp_path):
    """Under `ulimit -v`, the host arena maps its capacity alone where twice does not fit, said once;
    where not even that fits, one clear error instead of a bare `OSError [Errno 12]`."""
    out = subprocess.run([sys.executable, "-c", ADDRESS_SPACE, str(tmp_path / "nvme")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("the address-space limit (ulimit -v) leaves no room") == 1
    assert "fits" in out.stdout
    assert "refused: cannot map" in out.stdout and "Lower host_budget and device_budget" in out.stdout


def test_an_nvme_dir_that_reports_no_size_is_used_not_called_full(tmp_path, monkeypatch, caplog):
    """ramfs reports 0 bytes in all and 0 free (mounting one needs root, so its report stands in)."""
    import collections
    import shutil

    import outcore.runtime.engine_start as engine_start

    real = shutil.disk_usage
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(engine_start.shutil, "disk_usage",
                        lambda p: usage(0, 0, 0) if str(p).startswith(str(tmp_path)) else real(p))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with caplog.at_level("WARNING"):
        engine = outcore.Engine(model, outcore.Config(offload_params="nvme", offload_optimizer="nvme",
                                                      nvme_dir=str(tmp_path / "ram")))
    assert any("reports no size" in r.message for r in caplog.records)
    engine.backward(engine(torch.ones(2, 8)).sum())
    assert engine.step()["skipped"] is False
    engine.close()


EXPORT_FILLS = """
import os, resource, signal, sys, torch, outcore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG back instead of dying
engine = outcore.Engine(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]), outcore.Config())
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # the disk takes 1 MiB per file
try:
    engine.export(sys.argv[1])
except outcore.StorageError as e:
    print("refused:", e)
"""


@pytest.mark.slow
def test_an_export_onto_a_full_disk_is_one_clear_error(tmp_path):
    out = tmp_path / "model.safetensors"
    res = subprocess.run([sys.executable, "-c", EXPORT_FILLS, str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith(f"refused: export {str(out)!r}: writing") and "free space there" in res.stdout
    assert os.listdir(tmp_path) == []
