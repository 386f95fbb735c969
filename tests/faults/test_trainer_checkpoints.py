"""Round 3, the Trainer's checkpoints: `save_only_model` writes the model; a `checkpoint-N` whose
engine checkpoint is another run's or another step's is refused, naming both; an incomplete newest
checkpoint names the newest complete one before it."""

import json
import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "hf"))
from trainer_setup import TokenRows, model_dir, nvme_config, trainer_args  # noqa: E402

import outcore  # noqa: E402

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return model_dir(str(tmp_path_factory.mktemp("llama")))


def _run(tmp_path, model_path, name, steps=4, **args):
    trainer = outcore.hf.Trainer(model=model_path, args=trainer_args(str(tmp_path / name), max_steps=steps,
                                                                     save_strategy="steps", save_steps=2, **args),
                                 train_dataset=TokenRows(), outcore_config=nvme_config(str(tmp_path / f"{name}-nvme")))
    trainer.train()
    return trainer


def test_save_only_model_exports_the_model_into_each_checkpoint(tmp_path, model_path):
    trainer = _run(tmp_path, model_path, "run", save_only_model=True)
    final = trainer.engine.full_state_dict()
    trainer.engine.close()
    for n in (2, 4):
        saved = set(os.listdir(tmp_path / "run" / f"checkpoint-{n}"))
        assert {"config.json", "model.safetensors", "trainer_state.json"} <= saved
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "checkpoint-4"))
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, final[k])
    again = outcore.hf.Trainer(model=model_path, args=trainer_args(str(tmp_path / "again")), train_dataset=TokenRows(),
                               outcore_config=nvme_config(str(tmp_path / "nvme-again")))
    with pytest.raises(ValueError, match="save_only_model=True: it holds the model"):
        again.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    again.engine.close()


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, model_path):
    """Two runs of 4 steps (other seeds and rates), each saving at steps 2 and 4."""
    root = tmp_path_factory.mktemp("runs")
    for name, seed, lr in (("a", 7, 1e-3), ("b", 3, 5e-4)):
        _run(root, model_path, name, seed=seed, learning_rate=lr).engine.close()
    return root


def _resume(tmp_path, model_path, checkpoint):
    trainer = outcore.hf.Trainer(model=model_path, args=trainer_args(str(tmp_path / "resumed")),
                                 train_dataset=TokenRows(), outcore_config=nvme_config(str(tmp_path / "nvme-r")))
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    finally:
        trainer.engine.close()
    return trainer


def test_an_engine_checkpoint_of_another_step_is_refused_naming_both(tmp_path, model_path, two_runs):
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(two_runs / "a" / "checkpoint-2", ckpt)
    shutil.rmtree(ckpt / "outcore")
    shutil.copytree(two_runs / "a" / "checkpoint-4" / "outcore", ckpt / "outcore")
    with pytest.raises(ValueError, match=r"trainer state is at step 2.*saved at trainer step 4"):
        _resume(tmp_path, model_path, str(ckpt))


def test_an_engine_checkpoint_of_another_run_at_the_same_step_is_refused(tmp_path, model_path, two_runs):
    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(two_runs / "a" / "checkpoint-4", ckpt)
    shutil.rmtree(ckpt / "outcore")
    shutil.copytree(two_runs / "b" / "checkpoint-4" / "outcore", ckpt / "outcore")
    with pytest.raises(ValueError, match="written by another run"):
        _resume(tmp_path, model_path, str(ckpt))


@pytest.mark.slow
def test_the_run_s_own_checkpoint_resumes_and_keeps_the_run_id(tmp_path, model_path, two_runs):
    run = shutil.copytree(two_runs / "a", tmp_path / "a")
    trainer = outcore.hf.Trainer(model=model_path, args=trainer_args(str(run), max_steps=6, save_strategy="steps",
                                                                     save_steps=2),
                                 train_dataset=TokenRows(), outcore_config=nvme_config(str(tmp_path / "nvme-r")))
    trainer.train(resume_from_checkpoint=str(run / "checkpoint-4"))
    trainer.engine.close()
    assert trainer.state.global_step == 6
    ids = {json.loads((run / f"checkpoint-{n}" / "outcore_run.json").read_text())["run"] for n in (2, 4, 6)}
    assert len(ids) == 1


def test_an_incomplete_newest_checkpoint_names_the_previous_complete_one(tmp_path, model_path, two_runs):
    run = shutil.copytree(two_runs / "a", tmp_path / "a")
    newest = run / "checkpoint-4" / "outcore"
    for tag in os.listdir(newest):  # the engine's save died before its folder was in place
        path = newest / tag
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    trainer = outcore.hf.Trainer(model=model_path, args=trainer_args(str(run), max_steps=6), train_dataset=TokenRows(),
                                 outcore_config=nvme_config(str(tmp_path / "nvme-r")))
    with pytest.raises(ValueError, match=r"incomplete.*newest complete checkpoint before it is .*checkpoint-2"):
        trainer.train(resume_from_checkpoint=True)
    trainer.engine.close()
