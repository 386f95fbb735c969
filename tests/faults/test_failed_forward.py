"""A forward that raises (a token id past the vocabulary; Ctrl-C inside the model) leaves the engine as
before it: every unit let go, so an emergency save works, and the next steps equal those of a run
that never saw the failed forward."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from models import TinyGPT, batches  # noqa: E402

import outcore  # noqa: E402


def run(tmp_path, offload: str, failure: str | None) -> list[tuple[float, float]]:
    torch.manual_seed(0)
    model = TinyGPT()
    cfg = outcore.Config(offload_params=offload, offload_optimizer=offload, nvme_dir=str(tmp_path / "nvme"))
    engine = outcore.Engine(model, cfg, outcore.AdamW(lr=1e-3))
    out = []
    for i, (x, y) in enumerate(batches(4)):
        if failure is not None and i == 2:
            if failure == "bad-batch":
                bad = x.clone()
                bad[0, 0] = 10**6  # the embedding raises IndexError
                with pytest.raises(IndexError):
                    engine(bad, y)
            else:  # Ctrl-C arriving inside the second block's forward
                def interrupt(module, args):
                    raise KeyboardInterrupt

                hook = model.blocks[1].register_forward_pre_hook(interrupt)
                with pytest.raises(KeyboardInterrupt):
                    engine(x, y)
                hook.remove()
            engine.save_checkpoint(str(tmp_path / "ckpt"), "emergency")  # the save a user reaches for
            engine.export(str(tmp_path / "model.safetensors"))
        loss = engine(x, y)
        engine.backward(loss)
        out.append((float(loss), engine.step()["grad_norm"]))
    engine.close()
    return out


@pytest.mark.parametrize("offload", ["nvme", "cpu"])
@pytest.mark.parametrize("failure", ["bad-batch", "ctrl-c"])
def test_a_failed_forward_leaves_the_engine_whole(tmp_path, offload, failure):
    clean = run(tmp_path / "clean", offload, None)
    failed = run(tmp_path / "failed", offload, failure)
    assert [loss for loss, _ in failed] == [loss for loss, _ in clean]
    for (_, a), (_, b) in zip(failed, clean, strict=True):  # the norm's sum may run in another order
        assert a == pytest.approx(b, rel=1e-6)
    assert os.path.exists(tmp_path / "failed" / "ckpt" / "emergency" / "meta.json")
