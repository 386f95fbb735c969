"""torch.compile of a model the engine holds: the model's own code compiles, the engine's hooks run
eagerly, and training equals plain PyTorch's, compiled the same way. Traced, the hooks compiled
again for every unit (dynamo guarded on the unit's index and on the pending updates) and past the
first step, until dynamo's recompile limit."""

import logging

import pytest
import torch
from helpers import HP, assert_losses_match, train_plain, twins
from hf_models import deferred, save_model, token_batches
from models import TinyGPT, batches
from transformers import AutoModelForCausalLM

import outcore

BACKEND = "aot_eager"  # forward and backward graphs as inductor gets them, without a C++ build


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def anchor_warning_unsaid(monkeypatch):
    """The anchor's clipping warning is said once per process: unsaid, a test can see it."""
    from outcore.runtime.checkpoint.sharded_model import AnchorParameter

    monkeypatch.setattr(AnchorParameter, "_said", False)


def train_compiled(engine, model, steps, *, whole_engine=False):
    """`steps` of (args, kwargs) through `engine`, the model compiled in place (`whole_engine`:
    `torch.compile(engine)` instead); after the first step (which sees every shape), a recompile
    raises."""
    if whole_engine:
        call = torch.compile(engine, backend=BACKEND)
    else:
        model.compile(backend=BACKEND)
        call = engine
    losses = []
    for i, (args, kwargs) in enumerate(steps):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = call(*args, **kwargs)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("whole_engine", [False, True], ids=["model-in-place", "torch.compile(engine)"])
def test_a_compiled_model_trains_as_plain_pytorch_compiled_with_everything_on_nvme(tmp_path, caplog, whole_engine,
                                                                                   anchor_warning_unsaid):
    plain, model = twins(lambda: TinyGPT(tied=False))
    data = batches(5)
    ref = train_plain(torch.compile(plain, backend=BACKEND), data)
    torch._dynamo.reset()  # the engine's model runs the same code objects: compile them afresh
    config = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                            grad_clip=None)
    engine = outcore.Engine(model, config, outcore.AdamW(**HP))
    with caplog.at_level(logging.WARNING):
        losses = train_compiled(engine, model, [((x, y), {}) for x, y in data], whole_engine=whole_engine)
    assert_losses_match(losses, ref)
    ours = engine.full_state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert "clips nothing" not in caplog.text  # torch.compile probes every tensor's .grad, the anchor's too
    engine.close()


@pytest.mark.slow
def test_a_compiled_hugging_face_model_trains_as_plain_pytorch_compiled(tmp_path, caplog, anchor_warning_unsaid):
    directory = save_model("llama", str(tmp_path / "llama"))
    batch = token_batches(4)
    plain = AutoModelForCausalLM.from_pretrained(directory)
    opt = torch.optim.AdamW(plain.parameters(), **HP)
    compiled, ref = torch.compile(plain, backend=BACKEND), []
    for t in batch:
        loss = compiled(input_ids=t, labels=t, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    torch._dynamo.reset()
    model = deferred(directory)
    engine = outcore.Engine(model, outcore.Config(stage=3, grad_clip=None), outcore.AdamW(**HP), weights=directory)
    with caplog.at_level(logging.WARNING):
        losses = train_compiled(engine, model, [((), {"input_ids": t, "labels": t, "use_cache": False}) for t in batch])
        # `model.dtype` reads the anchor parameter, which a compiled function probes for a gradient
        assert torch.compile(lambda x: x.to(model.dtype) * 2, backend=BACKEND)(torch.ones(2)).tolist() == [2.0, 2.0]
    assert_losses_match(losses, ref)
    assert "clips nothing" not in caplog.text
    engine.close()


def test_train_batch_runs_a_compiled_model_uncompiled_and_says_so_once(tmp_path, caplog, monkeypatch):
    """Dynamo cannot trace the hooks that page train_batch's saved activations: it runs the model
    eagerly there (said once) and gives plain accumulation's numbers."""
    from outcore.runtime import vertical

    monkeypatch.setattr(vertical, "_said_uncompiled", False)
    plain, model = twins(lambda: TinyGPT(tied=False))
    data = batches(8)
    ref = train_plain(plain, data, accum=4)
    config = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                            grad_clip=None, grad_accumulation=4)
    engine = outcore.Engine(model, config, outcore.AdamW(**HP))
    model.compile(backend=BACKEND)
    with caplog.at_level(logging.WARNING, logger="outcore.runtime.vertical"):
        losses = [sum(engine.train_batch(data[i : i + 4])["losses"]) / 4 for i in (0, 4)]
    assert_losses_match(losses, ref)
    said = [r for r in caplog.records if "uncompiled" in r.getMessage()]
    assert len(said) == 1
    engine.close()


@pytest.mark.cuda
def test_a_model_compiled_by_inductor_on_a_gpu_trains_as_plain_pytorch_compiled(tmp_path, monkeypatch):
    """Inductor's own kernels (Triton) on the GPU, parameters and optimizer states on NVMe."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # its kernels go with tmp_path
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    device = torch.device("cuda", 0)
    plain, model = twins(lambda: TinyGPT(tied=False))
    data = [(x.to(device), y.to(device)) for x, y in batches(5)]
    ref = train_plain(torch.compile(plain.to(device)), data)
    torch._dynamo.reset()
    config = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"),
                            grad_clip=None)
    engine = outcore.Engine(model, config, outcore.AdamW(**HP), device=device)
    model.compile()
    losses = []
    for i, (x, y) in enumerate(data):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert_losses_match(losses, ref, rel=1e-4)
    ours = engine.full_state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(ours[name], value.cpu(), rtol=1e-4, atol=1e-5, msg=name)
    engine.close()
