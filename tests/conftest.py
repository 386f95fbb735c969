import os
import threading

import pytest
import torch

from outcore.offload import IOConfig, TieredStore, io_engine

SMALL_IO = IOConfig(block_size=64 << 10, queue_depth=8, threads=2)


def pytest_collection_modifyitems(config, items):
    """`cuda`-marked tests run where torch sees a GPU and are skipped, saying why, elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def make_store(tmp_path):
    """Build stores under tmp_path; every one is closed (and its swap file deleted) afterwards."""
    stores = []

    def make(**kw) -> TieredStore:
        kw.setdefault("nvme_dir", str(tmp_path / f"nvme{len(stores)}"))
        kw.setdefault("device", "cpu")
        kw.setdefault("device_budget", 16 << 20)
        kw.setdefault("host_budget", 16 << 20)
        kw.setdefault("io", SMALL_IO)
        kw.setdefault("wait_timeout", 5.0)
        store = TieredStore(**kw)
        stores.append(store)
        return store

    yield make
    for s in stores:
        s.close()
        assert not os.path.exists(s.state.swap.path), "swap file left behind"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class HeldWrites:
    """Swap-file writes that wait in their I/O worker while held (`hold()` ... `release()`)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.writing = threading.Event()  # a write arrived since `hold()`
        self.order: list[tuple[str, int]] = []  # ("write", offset) as each write goes to the file

    def hold(self) -> None:
        self.writing.clear()
        self.open.clear()

    def release(self) -> None:
        self.open.set()


@pytest.fixture
def held_writes(monkeypatch):
    """Hold the I/O workers' writes at will, to see what the store and engine do meanwhile."""
    held = HeldWrites()
    real = io_engine._pwrite_full

    def write(fd, view, offset):
        held.writing.set()
        assert held.open.wait(10), "a write stayed held for 10 s"
        held.order.append(("write", offset))
        real(fd, view, offset)

    monkeypatch.setattr(io_engine, "_pwrite_full", write)
    yield held
    held.release()  # (a failed check must not leave a worker held)
