import os

import pytest
import torch

from offload import IOConfig, TieredStore

SMALL_IO = IOConfig(block_size=64 << 10, queue_depth=8, threads=2)


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
        assert not os.path.exists(s._swap.path), "swap file left behind"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
