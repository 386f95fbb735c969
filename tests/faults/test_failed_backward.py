"""A backward that raises partway (an autograd node between two blocks; Ctrl-C) leaves the engine as
before that micro-step: its partial gradients dropped, every unit let go, so a save and an export
work, and the next steps equal those of a run that never saw it. Where updates had already started
beside the failed backward (no clipping), the engine refuses to go on until a checkpoint is loaded."""

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from helpers import InBackward, raising  # noqa: E402
from launch import free_port  # noqa: E402
from models import TinyGPT, batches  # noqa: E402

import outcore  # noqa: E402


def failing_after(block: torch.nn.Module, error: BaseException):
    """A hook that puts a node raising `error` in backward after `block` in forward; remove it after."""
    return block.register_forward_hook(lambda _module, _args, out: InBackward.apply(out, raising(error)))


def engine_for(tmp_path, offload: str, **config) -> tuple[outcore.Engine, TinyGPT]:
    torch.manual_seed(0)
    model = TinyGPT()
    cfg = outcore.Config(offload_params=offload, offload_optimizer=offload, nvme_dir=str(tmp_path / "nvme"), **config)
    return outcore.Engine(model, cfg, outcore.AdamW(lr=1e-3)), model


def train(tmp_path, offload: str, *, fail_at: int | None, how: str = "engine", after: int = 1,
          error: BaseException | None = None, **config) -> list[tuple[float, float | None]]:
    """Four steps; at step `fail_at` a backward raising after block `after`, then a save and an export.
    The clean run (`fail_at=None`) simply skips that batch: its steps are what the others must equal."""
    engine, model = engine_for(tmp_path, offload, **config)
    out = []
    for i, (x, y) in enumerate(batches(5)):
        if i == fail_at:
            error = error or ValueError("a node between two blocks failed")
            hook = failing_after(model.blocks[after], error)
            loss = engine(x, y)
            with pytest.raises(type(error)) as raised:
                if how == "engine":
                    engine.backward(loss)
                else:  # the caller's own loss.backward(): the engine learns of it at its next call
                    loss.backward()
            hook.remove()
            if how == "engine":
                assert any("outcore: a backward pass failed partway" in n for n in raised.value.__notes__)
            engine.save_checkpoint(str(tmp_path / "ckpt"), "emergency")
            engine.export(str(tmp_path / "model.safetensors"))
            assert engine.stats()["gathered"]["bytes"] == 0
            continue
        if fail_at is None and i == 2:
            continue
        loss = engine(x, y)
        engine.backward(loss)
        out.append((float(loss.detach()), engine.step()["grad_norm"]))
    engine.close()
    return out


def same_steps(a, b) -> None:
    assert [loss for loss, _ in a] == [loss for loss, _ in b]
    for (_, x), (_, y) in zip(a, b, strict=True):  # the norm's sum may run in another order
        assert x == y if y is None else x == pytest.approx(y, rel=1e-6)


@pytest.mark.parametrize("offload", ["nvme", "cpu"])
@pytest.mark.parametrize("how", ["engine", "plain"])
def test_a_failed_backward_is_undone_with_clipping(tmp_path, offload, how):
    clean = train(tmp_path / "clean", offload, fail_at=None, grad_clip=1.0)
    failed = train(tmp_path / "failed", offload, fail_at=2, how=how, grad_clip=1.0)
    same_steps(failed, clean)
    assert os.path.exists(tmp_path / "failed" / "ckpt" / "emergency" / "meta.json")


@pytest.mark.parametrize("how", ["engine", "plain"])
def test_a_failed_backward_before_any_update_is_undone_without_clipping(tmp_path, how):
    # after the last block: the first unit's gradient never came, so no update had started
    clean = train(tmp_path / "clean", "nvme", fail_at=None, grad_clip=None)
    failed = train(tmp_path / "failed", "nvme", fail_at=2, how=how, after=2, grad_clip=None)
    same_steps(failed, clean)


def test_ctrl_c_in_backward_is_undone(tmp_path):
    clean = train(tmp_path / "clean", "cpu", fail_at=None)
    failed = train(tmp_path / "failed", "cpu", fail_at=2, error=KeyboardInterrupt())
    same_steps(failed, clean)


@pytest.mark.parametrize("how", ["engine", "plain"])
def test_updates_already_streamed_stop_the_engine_until_a_load(tmp_path, how):
    engine, model = engine_for(tmp_path, "nvme", grad_clip=None)
    data = batches(4)
    for x, y in data[:2]:
        engine.backward(engine(x, y))
        engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"), "good")
    with torch.no_grad():
        expected = float(engine(*data[2]))  # the model as saved
    hook = failing_after(model.blocks[0], ValueError("boom"))  # blocks 2 and 1 are updated by then
    loss = engine(*data[2])
    with pytest.raises(ValueError):
        engine.backward(loss) if how == "engine" else loss.backward()
    hook.remove()
    calls = {"step": engine.step, "save": lambda: engine.save_checkpoint(str(tmp_path / "ckpt"), "bad"),
             "export": lambda: engine.export(str(tmp_path / "m.safetensors")),
             "forward": lambda: engine(*data[3]), "state dict": engine.full_state_dict}
    for what, call in calls.items():
        with pytest.raises(RuntimeError, match="load_checkpoint") as refused:
            call()
        assert "backward pass failed partway" in str(refused.value), what
        assert "\n" not in str(refused.value)
    assert not os.path.exists(tmp_path / "ckpt" / "bad")
    assert not os.path.exists(tmp_path / "m.safetensors")
    engine.load_checkpoint(str(tmp_path / "ckpt"), "good")
    with torch.no_grad():
        assert float(engine(*data[2])) == expected
    engine.backward(engine(*data[2]))  # and it trains on
    assert engine.step()["skipped"] is False
    engine.close()


def test_a_failed_train_batch_backward_is_undone(tmp_path):
    def run(fail: bool) -> list[float]:
        engine, model = engine_for(tmp_path / str(fail), "nvme", grad_clip=1.0)
        data = batches(6, batch=2)
        out = []
        for step in range(3):
            if fail and step == 1:
                hook = failing_after(model.blocks[1], KeyboardInterrupt())
                with pytest.raises(KeyboardInterrupt) as raised:
                    engine.train_batch([data[0], data[1]])
                hook.remove()
                assert raised.value.__notes__ == ["outcore: a train_batch failed partway (KeyboardInterrupt): the "
                                                  "engine is as before that micro-step."]
                engine.save_checkpoint(str(tmp_path / str(fail) / "ckpt"))
            stats = engine.train_batch(data[2 * step : 2 * step + 2])
            out.append((stats["losses"], stats["grad_norm"]))
        engine.close()
        return out

    clean, failed = run(False), run(True)
    assert [losses for losses, _ in failed] == [losses for losses, _ in clean]
    assert [n for _, n in failed] == pytest.approx([n for _, n in clean], rel=1e-6)


@pytest.mark.slow
def test_accumulation_a_failure_in_a_later_micro_step(tmp_path):
    """A backward that fails after adding into the window's gradients drops the whole window (their
    sum cannot be taken apart again): the run then equals one that skipped that window's batches. One
    that fails before any gradient came leaves the window as it was."""
    def run(tmp, plan: str) -> list[float]:
        engine, model = engine_for(tmp, "nvme", grad_clip=1.0, grad_accumulation=2)
        data = batches(8)
        norms = []
        for i, (x, y) in enumerate(data):
            if plan == "skip-window" and i in (2, 3):
                continue
            if plan in ("fail-summed", "fail-early") and i == 3:
                hook = failing_after(model.blocks[1 if plan == "fail-summed" else 2], ValueError("boom"))
                loss = engine(x, y)
                with pytest.raises(ValueError) as raised:
                    engine.backward(loss)
                hook.remove()
                note = " ".join(raised.value.__notes__)
                assert ("whole accumulation window was dropped" in note) == (plan == "fail-summed")
                if plan == "fail-early":  # the window's first micro-step stands: this one is tried again
                    engine.backward(engine(x, y))
                    norms.append(engine.step()["grad_norm"])
                continue
            engine.backward(engine(x, y))
            stats = engine.step()
            if not stats["accumulating"]:
                norms.append(stats["grad_norm"])
        engine.close()
        return norms

    assert run(tmp_path / "a", "fail-summed") == pytest.approx(run(tmp_path / "b", "skip-window"), rel=1e-6)
    assert run(tmp_path / "c", "fail-early") == pytest.approx(run(tmp_path / "d", "clean"), rel=1e-6)


RANK = """
import json, os, sys, time, torch
sys.path.insert(0, sys.argv[1])
from models import TinyGPT, batches
import outcore
from helpers import InBackward, raising
torch.manual_seed(0)
model = TinyGPT()
engine = outcore.Engine(model, outcore.Config(stage=int(sys.argv[3]), collective_timeout=20.0, grad_clip=None))
rank = engine.group.rank
report = {}
for i, (x, y) in enumerate(batches(3)):
    part = slice(rank * 2, rank * 2 + 2)
    hook = None
    if i == 1 and rank == 1:
        boom = raising(ValueError("boom"))
        hook = model.blocks[1].register_forward_hook(lambda m, a, out: InBackward.apply(out, boom))
    loss = engine(x[part], y[part])
    started = time.monotonic()
    try:
        engine.backward(loss)
        engine.step()
        report["gathered_between_steps"] = engine.stats()["gathered"]["bytes"]  # ZeRO-2 keeps them whole
    except Exception as e:
        report["error"] = type(e).__name__
        report["waited"] = time.monotonic() - started
        break
report["gathered"] = engine.stats()["gathered"]["bytes"]
for what, call in {"step": engine.step, "save": lambda: engine.save_checkpoint(os.path.join(sys.argv[2], "c"))}.items():
    try:
        call()
    except RuntimeError as e:
        report[what] = str(e)
json.dump(report, open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w"))
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_a_failed_backward_on_one_rank_stops_every_rank(tmp_path, stage):
    here = os.path.dirname(__file__)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": here}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, os.path.join(here, "..", "runtime"), str(tmp_path),
                               str(stage)], env={**env, "RANK": str(r)}, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outputs = [p.communicate(timeout=120)[0] for p in ranks]
    for p, out in zip(ranks, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert reports[1]["error"] == "ValueError"
    assert reports[0]["error"] == "RanksLostError"
    assert reports[0]["waited"] < 20  # told by the failing rank, not left to the timeout
    for report in reports:
        assert report["gathered"] == report["gathered_between_steps"]
        for what in ("step", "save"):
            assert "Restart every rank" in report[what] and "load_checkpoint" in report[what]
    assert not os.path.exists(tmp_path / "c")
