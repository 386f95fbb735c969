"""Issue 71, item 1 under the Trainer: with gradient checkpointing, what autograd saves outside the
checkpointed layers pages to NVMe (`offload_activations="nvme"`), in the trainer's one-call
`train_batch` and in its call-per-micro-batch path (DPO's reference), and the run is the unpaged
run bit for bit."""

import dataclasses

import pytest
import torch
from trainer_setup import TokenRows, logged, nvme_config, trainer_args

import outcore
from outcore.runtime import saved_activations

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("calls_again", [False, True])
def test_the_trainer_pages_activations_bit_for_bit(tmp_path, model_path, monkeypatch, calls_again):
    monkeypatch.setattr(saved_activations, "PAGED_BYTES", 1 << 10)
    if calls_again:  # each micro-batch its own engine(...) and backward, as under DPO and GRPO
        monkeypatch.setattr(outcore.hf.Trainer, "_calls_model_again", lambda self: True)
    runs = {}
    for mode in ("none", "nvme"):
        config = dataclasses.replace(nvme_config(str(tmp_path / f"nvme-{mode}")), offload_activations=mode)
        trainer = outcore.hf.Trainer(model=model_path, train_dataset=TokenRows(n=8),
                                     args=trainer_args(str(tmp_path / mode), max_steps=2, gradient_checkpointing=True),
                                     outcore_config=config)
        trainer.train()
        runs[mode] = trainer, logged(trainer), trainer.engine.stats()["activations"]
    (ref, ref_losses, ref_paged), (ours, losses, paged) = runs["none"], runs["nvme"]
    assert losses == ref_losses
    assert ref_paged["bytes_paged"] == 0 < paged["bytes_paged"] and paged["bytes_from_nvme"] <= paged["bytes_paged"]
    for (k, v), (k2, w) in zip(ref.engine.full_state_dict().items(), ours.engine.full_state_dict().items(),
                               strict=True):
        assert k == k2 and torch.equal(v, w), k
    for trainer in (ref, ours):
        trainer.engine.close()
