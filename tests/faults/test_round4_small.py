"""Round 4's small ones: an export that replaces a model says so; the estimate says a --nvme-dir that
does not exist yet; a disk that fills while the base is quantized leaves no folder behind; a plain
Trainer's checkpoint is named as one; two trainers on one output_dir in one process take turns, and
one that would write beside a live one is refused before it writes."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import outcore
from outcore.offload.scratch_dir import DirectoryLock
from outcore.tools.cli import main

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "hf"))
from trainer_setup import TokenRows, model_dir, nvme_config, trainer_args  # noqa: E402


def test_an_export_over_a_model_says_what_it_replaced(tmp_path, caplog):
    engine = outcore.Engine(torch.nn.Sequential(torch.nn.Linear(4, 4)), outcore.Config())
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_bytes(b"a model of the user's")
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with caplog.at_level(logging.WARNING):
        engine.export(str(tmp_path / "out"))
        engine.export(str(tmp_path / "one.safetensors"))
        engine.export(str(tmp_path / "one.safetensors"))
    engine.close()
    said = [r.getMessage() for r in caplog.records]
    assert f"export {tmp_path / 'out'}: replaced what the folder held under the names it writes: model.safetensors" \
        in said
    assert said.count(f"export {tmp_path / 'one.safetensors'}: replaced the file that was there") == 1
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_the_estimate_says_an_nvme_dir_that_does_not_exist_yet(tmp_path, capsys):
    assert main(["estimate", "--params", "125M", "--nvme-dir", str(tmp_path / "a" / "b")]) == 0
    out = capsys.readouterr().out
    assert f"--nvme-dir {tmp_path / 'a' / 'b'} does not exist yet (a run makes it, in {tmp_path}, where" in out
    assert not (tmp_path / "a").exists()


FILLS_WHILE_QUANTIZING = textwrap.dedent("""
    import os, resource, signal, sys
    import peft, outcore
    sys.path.insert(0, sys.argv[3])
    from hf_models import deferred, save_model
    directory = save_model("llama", sys.argv[2])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG back instead of dying
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 10, 4 << 10))  # the disk takes 4 KiB a file
    config = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=sys.argv[1],
                            quantize="nf4")
    model = peft.get_peft_model(deferred(directory), peft.LoraConfig(r=2, target_modules="all-linear"))
    try:
        outcore.Engine(model, config, outcore.AdamW(lr=1e-3), weights=directory)
    except outcore.StorageFullError as e:
        print("full:", e)
    print("left:", sorted(os.listdir(sys.argv[1])) if os.path.exists(sys.argv[1]) else "nothing")
""")


@pytest.mark.slow
def test_a_disk_that_fills_while_quantizing_leaves_no_folder_behind(tmp_path):
    pytest.importorskip("bitsandbytes")
    runtime_tests = os.path.join(os.path.dirname(__file__), "..", "runtime")
    res = subprocess.run([sys.executable, "-c", FILLS_WHILE_QUANTIZING, str(tmp_path / "nv"), str(tmp_path / "m"),
                          runtime_tests], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"full: NVMe directory '{tmp_path / 'nv'}' is full" in res.stdout
    assert res.stdout.strip().splitlines()[-1] == "left: nothing"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    pytest.importorskip("transformers")
    return model_dir(str(tmp_path_factory.mktemp("llama")))


def _trainer(tmp_path, model_path, out, nvme, **args):
    return outcore.hf.Trainer(model=model_path, args=trainer_args(str(tmp_path / out), **args),
                              train_dataset=TokenRows(), outcore_config=nvme_config(str(tmp_path / nvme)))


@pytest.mark.slow
def test_a_plain_trainer_s_checkpoint_is_named_as_one(tmp_path, model_path):
    plain = tmp_path / "plain" / "checkpoint-2"
    plain.mkdir(parents=True)
    for name in ("optimizer.pt", "scheduler.pt", "model.safetensors", "config.json"):
        (plain / name).write_bytes(b"")
    (plain / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    trainer = _trainer(tmp_path, model_path, "run", "nvme")
    with pytest.raises(ValueError, match="is a plain Trainer's checkpoint .its optimizer.pt holds torch's optimizer"):
        trainer.train(resume_from_checkpoint=str(plain))
    trainer.engine.close()


@pytest.mark.slow
def test_two_trainers_on_one_output_dir_take_turns(tmp_path, model_path):
    a = _trainer(tmp_path, model_path, "out", "nvme-a", max_steps=2, save_strategy="steps", save_steps=1)
    a.train()
    b = _trainer(tmp_path, model_path, "out", "nvme-b", max_steps=2, save_strategy="steps", save_steps=1)
    b.train()  # a is done: its hold on out/ and on the checkpoint it saved last is let go
    assert {"checkpoint-1", "checkpoint-2"} <= set(os.listdir(tmp_path / "out"))
    assert not [n for n in os.listdir(tmp_path / "out") if n.endswith(".lock")]
    a.engine.close()
    b.engine.close()


@pytest.mark.slow
def test_a_trainer_on_an_output_dir_in_use_is_refused_before_it_writes(tmp_path, model_path):
    (tmp_path / "out").mkdir()
    live = DirectoryLock(str(tmp_path / "out"), 0, what="output_dir", prefix=".outcore-trainer-")  # a training one
    b = _trainer(tmp_path, model_path, "out", "nvme-b", max_steps=2, save_strategy="steps", save_steps=1)
    with pytest.raises(outcore.StorageError, match="is in use by another live run of this process \\(an engine or "
                                                   f"trainer still open\\) \\(pid {os.getpid()}"):
        b.train()
    assert sorted(os.listdir(tmp_path / "out")) == [".outcore-trainer-rank0.lock"]
    live.release(remove=True)
    b.engine.close()
