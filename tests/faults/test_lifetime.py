"""An engine's lifetime: a script that ends without `close()`, its updates and write-backs still in
flight, exits cleanly and its swap files go (offload/exit_close.py), while the forked DataLoader
workers of one that goes on close nothing of their parent's; an engine used after `close()` says
so."""

import os
import subprocess
import sys

import pytest

import outcore

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter from the repository root; asserts it exited 0."""
    res = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert res.returncode == 0, res.stderr[-3000:]
    return res

# Every swap-file write is slowed, so the last step's updates are surely still running at exit.
SLOW_WRITES = r"""
import sys, time
from outcore.offload import io_engine
real = io_engine._pwrite_full
def slow(fd, view, offset):
    time.sleep(0.02)
    real(fd, view, offset)
io_engine._pwrite_full = slow
nvme = sys.argv[1]
"""

ENGINE = SLOW_WRITES + r"""
import outcore
from tests.runtime.models import TinyGPT, batches
cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=nvme,
                     io={"block_size": 64 << 10, "threads": 2})
engine = outcore.Engine(TinyGPT(), cfg, outcore.AdamW(lr=1e-3))
for x, y in batches(3):
    engine.backward(engine(x, y))
    engine.step()
assert engine.updates.in_flight(), "nothing in flight: the test would not test the exit"
print("steps done", flush=True)
"""

STORE = SLOW_WRITES + r"""
import torch
from outcore.offload import Tier, TieredStore
store = TieredStore(nvme, host_budget=1 << 20, device_budget=1 << 20)
for i in range(8):
    store.put(f"k{i}", torch.full((1 << 16,), float(i)), Tier.NVME)
print("puts done", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("script", [ENGINE, STORE], ids=["engine", "store"])
def test_a_script_that_never_closes_exits_cleanly_and_leaves_no_swap_file(tmp_path, script):
    nvme = tmp_path / "nvme"
    res = run_script(script, str(nvme))
    assert "done" in res.stdout
    assert "Traceback" not in res.stderr and "cannot schedule" not in res.stderr, res.stderr[-3000:]
    assert not [n for n in os.listdir(nvme) if n.endswith(".swap")], os.listdir(nvme)


FORKED_WORKERS = r"""
import os, sys, torch, outcore
from tests.runtime.models import TinyGPT, batches
nvme = sys.argv[1]
cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=nvme)
engine = outcore.Engine(TinyGPT(), cfg, outcore.AdamW(lr=1e-3))
data = batches(4)
loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=2, multiprocessing_context="fork")
for epoch in range(2):  # the workers exit at the end of each epoch
    for x, y in loader:
        engine.backward(engine(x, y))
        engine.step()
    print(sorted(os.listdir(nvme)), flush=True)
engine.close()
print(sorted(os.listdir(nvme)))
"""


@pytest.mark.slow
def test_forked_dataloader_workers_leave_their_parents_swap_file_alone(tmp_path):
    nvme = tmp_path / "nvme"
    res = run_script(FORKED_WORKERS, str(nvme))
    assert res.stdout.split("\n")[:3] == ["['rank0.lock', 'rank0.swap']"] * 2 + ["[]"], res.stdout
    assert "at exit failed" not in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]


def test_an_engine_used_after_close_says_it_was_closed(tmp_path):
    from tests.runtime.models import TinyGPT, batches

    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"))
    engine = outcore.Engine(TinyGPT(), cfg, outcore.AdamW(lr=1e-3))
    (x, y), = batches(1)
    engine.backward(engine(x, y))
    engine.step()
    engine.close()
    engine.close()  # twice is harmless
    calls = {"__call__": lambda: engine(x, y), "step": engine.step, "full_state_dict": engine.full_state_dict,
             "train_batch": lambda: engine.train_batch([(x, y)]),
             "save_checkpoint": lambda: engine.save_checkpoint(str(tmp_path / "ckpt"), "t"),
             "export": lambda: engine.export(str(tmp_path / "m.safetensors"))}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"Engine.{name}: this engine was closed.*build a new Engine"):
            call()
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "m.safetensors").exists()


FORKED_CHILD = r"""
import os, sys, outcore
from tests.runtime.models import TinyGPT, batches
cfg = outcore.Config(stage=3, offload_params="cpu", offload_optimizer="cpu")  # no nvme_dir: a scratch folder
engine = outcore.Engine(TinyGPT(), cfg, outcore.AdamW(lr=1e-3))
scratch = os.path.dirname(engine.store.state.swap.path)
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit: atexit and the thread-exit hooks run in the child
os.waitpid(pid, 0)
print(os.path.isdir(scratch), flush=True)
(x, y), = batches(1)
engine.backward(engine(x, y))
engine.step()
engine.close()
print(os.path.isdir(scratch))
"""


@pytest.mark.slow
def test_a_forked_child_that_exits_leaves_its_parents_scratch_folder(tmp_path):
    res = run_script(FORKED_CHILD, env={"TMPDIR": str(tmp_path)})
    assert res.stdout.split() == ["True", "False"], res.stdout + res.stderr[-2000:]


def _corrupt(swap):
    """One byte flipped in every page of the swap file: every key's stored bytes."""
    raw = bytearray(swap.read_bytes())
    raw[::4096] = bytes(b ^ 0xFF for b in raw[::4096])
    swap.write_bytes(raw)


def _paging_engine(nvme):
    """A GPT larger than its 1 MiB budgets: each step reads and writes the swap file."""
    from tests.runtime.models import TinyGPT

    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(nvme), grad_clip=None,
                         device_budget=1 << 20, host_budget=1 << 20, sub_group_size=1 << 12)
    return outcore.Engine(TinyGPT(vocab=256, d=64, layers=4, seq=32), cfg, outcore.AdamW(lr=1e-3))


def _steps(engine, data):
    """Train on `data`, one step a batch, and wait for the updates: the losses."""
    from tests.runtime.helpers import train_engine

    losses, _ = train_engine(None, None, data, engine=engine)
    engine.synchronize()
    return losses


def test_a_swap_file_corrupted_mid_run_fails_the_run_once_and_close_still_cleans_up(tmp_path):
    from outcore.offload import StorageCorruptError
    from tests.runtime.models import batches

    nvme = tmp_path / "nvme"
    engine = _paging_engine(nvme)
    data = batches(2, seq=32, vocab=256)
    _steps(engine, data)
    _corrupt(nvme / "rank0.swap")
    with pytest.raises(StorageCorruptError, match="checksum mismatch"):
        _steps(engine, data)
    # Some units were updated and some not: the engine refuses to go on, naming why.
    with pytest.raises(RuntimeError, match="states partly written.*load_checkpoint"):
        _steps(engine, data[:1])
    engine.close()  # the error was raised once, above: closing frees everything without raising it again
    assert os.listdir(nvme) == []


def test_an_update_error_nobody_saw_is_raised_by_close_after_it_cleaned_up(tmp_path):
    from outcore.offload import StorageCorruptError
    from tests.runtime.models import TinyGPT, batches

    nvme = tmp_path / "nvme"
    # Clipping: step() starts the updates after backward and returns; they read the states on NVMe.
    cfg = outcore.Config(stage=3, offload_params="cpu", offload_optimizer="nvme", nvme_dir=str(nvme), grad_clip=1.0,
                         host_budget=1 << 21, sub_group_size=1 << 12)
    engine = outcore.Engine(TinyGPT(vocab=256, d=64, layers=4, seq=32), cfg, outcore.AdamW(lr=1e-3))
    (x, y), = batches(1, seq=32, vocab=256)
    engine.backward(engine(x, y))
    engine.step()
    engine.synchronize()
    _corrupt(nvme / "rank0.swap")
    engine.backward(engine(x, y))  # parameters in HOST: nothing here reads the swap file
    engine.step()
    with pytest.raises(StorageCorruptError, match="checksum mismatch"):
        engine.close()
    assert os.listdir(nvme) == []


def test_a_corrupt_parameter_read_in_forward_is_the_same_error_each_time(tmp_path):
    from outcore.offload import StorageCorruptError
    from tests.runtime.models import TinyGPT, batches

    nvme = tmp_path / "nvme"
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(nvme), grad_clip=None)
    engine = outcore.Engine(TinyGPT(), cfg, outcore.AdamW(lr=1e-3))
    (x, y), = batches(1)
    engine.backward(engine(x, y))
    engine.step()
    engine.synchronize()
    swap = engine.store.state.swap
    keys = [u.param_key for u in engine.units]
    for key in keys:
        engine.store.evict(key).wait()  # every unit's parameters are read back from the file
    with open(swap.path, "r+b") as f:
        for key in keys:
            f.seek(swap.entry(key).extent.offset)
            f.write(b"\xff\x00\xff")
    for _ in range(2):  # not "in use" the second time: the failed fetch left no pin behind
        with pytest.raises(StorageCorruptError, match="checksum mismatch"):
            engine(x, y)
    engine.close()
    assert os.listdir(nvme) == []


def test_a_checkpoint_load_mends_an_engine_whose_update_failed(tmp_path):
    from outcore.offload import StorageCorruptError
    from tests.runtime.models import batches

    nvme, ckpt = tmp_path / "nvme", str(tmp_path / "ckpt")
    engine = _paging_engine(nvme)
    data = batches(4, seq=32, vocab=256)
    _steps(engine, data[:2])
    engine.save_checkpoint(ckpt, "two")
    after = _steps(engine, data[2:])
    _corrupt(nvme / "rank0.swap")
    with pytest.raises(StorageCorruptError):
        _steps(engine, data[2:])
    engine.load_checkpoint(ckpt, "two")  # every state is the checkpoint's again: the engine goes on
    assert _steps(engine, data[2:]) == pytest.approx(after, rel=1e-6)
    engine.close()


def test_a_load_that_fails_partway_leaves_the_engine_refusing(tmp_path, monkeypatch):
    from outcore.runtime.checkpoint import sharded as checkpoint
    from tests.runtime.models import TinyGPT, batches

    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"))
    engine = outcore.Engine(TinyGPT(), cfg, outcore.AdamW(lr=1e-3))
    (x, y), = batches(1)
    engine.backward(engine(x, y))
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"), "one")
    overwrite, calls = checkpoint._overwrite, []

    def fails_on_the_third(*args, **kwargs):  # an I/O error after some states were loaded
        calls.append(1)
        if len(calls) == 3:
            raise OSError(5, "Input/output error")
        overwrite(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "_overwrite", fails_on_the_third)
    with pytest.raises(OSError, match="Input/output error"):
        engine.load_checkpoint(str(tmp_path / "ckpt"), "one")
    with pytest.raises(RuntimeError, match="partly written .OSError.*load_checkpoint"):
        engine.backward(engine(x, y))
    monkeypatch.setattr(checkpoint, "_overwrite", overwrite)
    engine.load_checkpoint(str(tmp_path / "ckpt"), "one")  # a whole load mends it
    engine.backward(engine(x, y))
    engine.step()
    engine.close()
