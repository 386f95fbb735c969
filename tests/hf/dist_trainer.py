"""Run under torchrun by test_trainer.py: outcore's Trainer at `batch` per rank; rank 0 writes the
logged losses and the final weights."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from trainer_setup import TokenRows, logged, nvme_config, trainer_args  # noqa: E402

import outcore  # noqa: E402


def main(model_path: str, run_dir: str, out: str, batch: int) -> None:
    args = trainer_args(os.path.join(run_dir, "run"), per_device_train_batch_size=batch)
    trainer = outcore.hf.Trainer(model=model_path, args=args, train_dataset=TokenRows(),
                                 outcore_config=nvme_config(os.path.join(run_dir, "nvme")))
    trainer.train()
    state = trainer.engine.full_state_dict()
    if trainer.engine.group.rank == 0:
        torch.save(state, out + ".pt")
        json.dump({"world": trainer.engine.group.world, "losses": logged(trainer), "weights": out + ".pt"},
                  open(out, "w"))
    trainer.engine.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
