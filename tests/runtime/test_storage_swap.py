"""One rank on a torch that cannot swap storages' memory: units are gathered by a copy, said once,
and training equals plain PyTorch as when the shard is borrowed."""

import logging
import types

import pytest
import torch
from helpers import assert_losses_match, train_engine, train_plain, twins
from models import TinyGPT, batches

import outcore
from outcore.runtime import flat_unit, storage_swap


@pytest.fixture
def torch_without_swap(monkeypatch):
    """`storage_swap` sees a torch whose UntypedStorage has no `_swap_data_ptr_` (torch 2.11's)."""
    old = types.SimpleNamespace(UntypedStorage=type("UntypedStorage", (), {}), __version__="2.11.0")
    monkeypatch.setattr(storage_swap, "torch", old)
    storage_swap.storage_swap_available.cache_clear()

    def refuse(a, b):
        raise AssertionError("swapped storages on a torch that cannot")

    monkeypatch.setattr(flat_unit, "swap_storage_memory", refuse)
    yield
    storage_swap.storage_swap_available.cache_clear()


def test_the_running_torch_can_swap_so_one_rank_borrows(tmp_path):
    assert storage_swap.storage_swap_available()
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path))
    engine = outcore.Engine(TinyGPT(), cfg, outcore.AdamW(lr=1e-3))
    x, y = batches(1)[0]
    engine(x, y)
    assert any(u.borrowed for u in engine.units)
    engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("params, optim, clip", [("nvme", "nvme", 1.0), ("cpu", "none", None)])
def test_without_the_swap_units_are_copied_and_train_as_plain_pytorch(tmp_path, caplog, torch_without_swap,
                                                                     params, optim, clip):
    cfg = outcore.Config(stage=3, offload_params=params, offload_optimizer=optim, nvme_dir=str(tmp_path),
                         grad_clip=clip)
    ours_model, ref_model = twins(TinyGPT)
    data = batches(8)
    with caplog.at_level(logging.WARNING, logger="outcore"):
        ours, engine = train_engine(ours_model, cfg, data)
    assert not engine.policy.borrowing
    assert not any(u.borrowed for u in engine.units)
    said = [r for r in caplog.records if "_swap_data_ptr_" in r.getMessage()]
    assert len(said) == 1 and "2.11.0" in said[0].getMessage()
    assert_losses_match(ours, train_plain(ref_model, data, clip=clip))
    sd, want = engine.full_state_dict(), ref_model.state_dict()
    for k in want:
        torch.testing.assert_close(sd[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    engine.close()


def test_without_the_swap_other_layouts_say_nothing(tmp_path, caplog, torch_without_swap):
    cfg = outcore.Config(stage=3, offload_params="none", offload_optimizer="nvme", nvme_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="outcore"):
        engine = outcore.Engine(TinyGPT(), cfg, outcore.AdamW(lr=1e-3))
    assert not [r for r in caplog.records if "_swap_data_ptr_" in r.getMessage()]
    engine.close()
