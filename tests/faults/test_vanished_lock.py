"""Round 3: the folder holding a checkpoint lock removed by another program (a rotation, an upload
job): the lock is let go quietly, the next save there takes a new one, and close() closes the store."""

import os
import shutil

import torch

import outcore


def test_saves_and_close_go_on_after_the_checkpoint_folder_vanished(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    engine = outcore.Engine(model, outcore.Config(offload_params="nvme", offload_optimizer="nvme",
                                                  nvme_dir=str(tmp_path / "nvme")), outcore.AdamW(lr=1e-3))
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(str(ckpt), "one")
    shutil.rmtree(ckpt)
    engine.save_checkpoint(str(ckpt), "two")  # the folder made again, and a lock taken in it
    assert os.path.exists(ckpt / ".outcore-rank0.lock")
    assert engine.load_checkpoint(str(ckpt))["tag"] == "two"
    shutil.rmtree(ckpt)
    swap = engine.store.state.swap.path
    engine.close()
    assert not os.path.exists(swap), "the store was not closed"
