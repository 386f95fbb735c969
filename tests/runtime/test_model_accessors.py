"""What the model's own accessors give while the engine holds its parameters. A parameter attribute
under ZeRO-3: the gathered values while its unit runs, and between times a stand-in that knows its
shape and refuses to be read (it once was a view of freed memory, and reading it crashed the
process). `state_dict()`: an error naming what reads the weights, where it once returned the
buffers alone, which saved looked like a checkpoint and held no weight."""

import os

import pytest
import torch
from hf_models import deferred, save_model
from models import TinyGPT, batches

import outcore
from outcore.runtime.released import ReleasedParameter, ReleasedParameterError


def engine_for(tmp_path, **kw):
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, d=32, tied=False)
    cfg = outcore.Config(nvme_dir=str(tmp_path), sub_group_size=4096, **kw)
    return model, outcore.Engine(model, cfg, outcore.AdamW(lr=1e-2))


@pytest.mark.parametrize("offload", ["nvme", "cpu"])
def test_a_released_parameter_keeps_its_shape_and_refuses_to_be_read(tmp_path, offload):
    model, engine = engine_for(tmp_path, stage=3, offload_params=offload, offload_optimizer=offload)
    for when in ("before the first step", "after a step"):
        w = model.blocks[1].ln1.weight
        assert isinstance(w, ReleasedParameter), when
        assert w.shape == (32,) and w.dtype == torch.float32 and w.requires_grad and w.numel() == 32
        assert w.device == torch.device("cpu")  # where it is gathered
        with pytest.raises(outcore.ReleasedParameterError, match=r"blocks\.1\.ln1\.weight was read while its unit "
                                                         r"\(blocks\.1\) is released.*full_state_dict"):
            float(model.blocks[1].ln1.weight.sum())
        with pytest.raises(outcore.ReleasedParameterError):
            print(model.head.weight)
        with pytest.raises(outcore.ReleasedParameterError):
            torch.cat([model.tok.weight, model.head.weight])
        for x, y in batches(2, batch=2, vocab=128):
            engine.backward(engine(x, y))
            engine.step()
    engine.close()


def test_inside_its_modules_forward_a_parameter_holds_the_current_values(tmp_path):
    model, engine = engine_for(tmp_path, stage=3, offload_params="nvme", offload_optimizer="nvme")
    seen = []
    model.blocks[1].mlp[0].register_forward_hook(lambda m, i, o: seen.append(m.weight.detach().clone()))
    for x, y in batches(3, batch=2, vocab=128):
        engine.synchronize()
        expected = engine.full_state_dict()["blocks.1.mlp.0.weight"]
        engine.backward(engine(x, y))
        engine.step()
        torch.testing.assert_close(seen[-1], expected, rtol=0, atol=0)
    assert not torch.equal(seen[0], seen[-1])  # the updates reached the gathered values
    engine.close()


@pytest.mark.parametrize("stage", [1, 2, 3])  # one rank at stage 3 with nothing offloaded: the shard itself
def test_resident_parameters_stay_readable(tmp_path, stage):
    model, engine = engine_for(tmp_path, stage=stage)
    assert not isinstance(model.blocks[1].ln1.weight, ReleasedParameter)
    for x, y in batches(2, batch=2, vocab=128):
        engine.backward(engine(x, y))
        engine.step()
    engine.synchronize()
    torch.testing.assert_close(model.blocks[1].ln1.weight.detach(), engine.full_state_dict()["blocks.1.ln1.weight"],
                               rtol=0, atol=0)
    engine.close()


@pytest.mark.parametrize("stage", [3, 2])
def test_state_dict_of_the_model_or_a_submodule_names_what_reads_the_weights(tmp_path, stage):
    model, engine = engine_for(tmp_path, stage=stage, offload_optimizer="nvme")
    engine.backward(engine(*batches(1, batch=2, vocab=128)[0]))
    engine.step()
    for module in (model, model.blocks[1], model.head):
        with pytest.raises(RuntimeError, match=r"state_dict\(\) was called on a module whose parameters outcore's "
                                               r"engine holds.*engine\.full_state_dict\(\).*engine\.export"):
            module.state_dict()
    assert len(engine.full_state_dict()) == len(TinyGPT(vocab=128, d=32, tied=False).state_dict())
    engine.close()


def test_load_state_dict_into_the_model_is_refused_naming_weights_and_load_checkpoint(tmp_path):
    """Before, torch's own error: the anchor missing and every real key unexpected."""
    model, engine = engine_for(tmp_path, stage=3, offload_optimizer="nvme")
    trained = engine.full_state_dict()
    zeros = {k: torch.zeros_like(v) for k, v in trained.items()}
    for module, state in ((model, zeros), (model.head, {k[len("head."):]: v for k, v in zeros.items()
                                                        if k.startswith("head.")})):
        with pytest.raises(RuntimeError, match=r"load_state_dict\(\) was called .*weights=path.*load_checkpoint"):
            module.load_state_dict(state)
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in trained.items())
    engine.save_checkpoint(str(tmp_path / "ckpt"))  # the engine's own load of the buffers still runs
    engine.load_checkpoint(str(tmp_path / "ckpt"))
    engine.close()


def test_save_pretrained_fails_the_same_way_and_export_writes_the_model(tmp_path):
    directory = save_model("llama", str(tmp_path / "src"))
    engine = outcore.Engine(deferred(directory), outcore.Config(nvme_dir=str(tmp_path / "nvme")), weights=directory)
    saved = tmp_path / "saved"
    with pytest.raises(RuntimeError, match=r"engine\.export\(path\).*in place of save_pretrained"):
        engine.module.save_pretrained(str(saved))
    assert not saved.exists() or not [f for f in os.listdir(saved) if f.endswith(".safetensors")]
    engine.export(str(tmp_path / "exported"))
    assert "model.safetensors" in os.listdir(tmp_path / "exported")
    engine.close()


def test_clipping_model_parameters_says_once_that_it_clips_nothing(tmp_path, monkeypatch, caplog):
    """`model.parameters()` yields only the empty anchor: a plain PyTorch clip over it finds no
    gradient. That is said once in the log, naming Config.grad_clip, and training goes on."""
    from outcore.runtime.checkpoint.sharded_model import AnchorParameter

    monkeypatch.setattr(AnchorParameter, "_said", False)
    model, engine = engine_for(tmp_path, stage=3, offload_params="nvme", offload_optimizer="nvme", grad_clip=1.0)
    assert [type(p) for p in model.parameters()] == [AnchorParameter]
    with caplog.at_level("WARNING", logger="outcore.runtime.checkpoint.sharded_model"):
        model.to("cpu").float()  # these read every parameter's .grad to move it: not the habit warned of
        model.zero_grad()  # clears nothing, loses nothing (a Trainer's loop calls it every step)
    assert not [r for r in caplog.records if "clips nothing" in r.getMessage()]
    norms = []
    for x, y in batches(2, batch=2, vocab=128):
        engine.backward(engine(x, y))
        with caplog.at_level("WARNING", logger="outcore.runtime.checkpoint.sharded_model"):
            assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) == 0.0
        norms.append(engine.step()["grad_norm"])
    said = [r for r in caplog.records if "clips nothing" in r.getMessage()]
    assert len(said) == 1 and "Config.grad_clip" in said[0].getMessage()
    assert all(n is not None and n > 0 for n in norms)  # the engine's own norm and clip
    engine.close()


def test_engine_train_and_eval_set_the_model_mode(tmp_path):
    """As on a DeepSpeed engine: `engine.eval()` turns dropout off (two forwards agree), `engine.train()` on."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 16))
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path))
    engine = outcore.Engine(model, cfg, outcore.AdamW(lr=1e-3))
    x = torch.randn(8, 16)
    with torch.no_grad():
        assert engine.eval() is engine and not model.training and not model[1].training
        assert torch.equal(engine(x), engine(x))
        assert engine.train() is engine and model.training and model[1].training
        assert not torch.equal(engine(x), engine(x))
    engine.close()


def test_a_model_an_engine_holds_is_refused_by_a_second_engine_and_says_so_after_close(tmp_path):
    """A second Engine on the same model failed with the state-dict guard's words (as if the user
    had called state_dict()); a read after close() said the unit was released, as between steps."""
    model, engine = engine_for(tmp_path / "a", stage=3, offload_params="nvme", offload_optimizer="nvme")
    again = outcore.Config(nvme_dir=str(tmp_path / "b"))
    with pytest.raises(ValueError, match="already wrapped by an outcore Engine.*build the model again"):
        outcore.Engine(model, again)
    x, y = batches(1, vocab=128)[0]
    engine.backward(engine(x, y))
    engine.step()
    engine.close()
    with pytest.raises(ReleasedParameterError, match=r"tok.weight was read after the engine holding it was closed"):
        model(x, y)
    with pytest.raises(ValueError, match="already wrapped"):
        outcore.Engine(model, again)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("convert", [lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.double()])
def test_a_model_converted_after_wrapping_is_refused_at_its_next_forward(tmp_path, convert):
    """Before, .half() converted the buffers and the anchor and left the weights in fp32: the
    model ran on, mixed, without a word."""
    model, engine = engine_for(tmp_path, stage=3, offload_params="nvme", offload_optimizer="nvme")
    x, y = batches(1, batch=2, vocab=128)[0]
    with torch.no_grad():
        before = engine(x, y)
        engine.module.to("cpu").float()  # where it already is, as it already is: no change
        assert torch.equal(engine(x, y), before)
        convert(engine.module)
        for run in (lambda: engine(x, y), lambda: engine.module(x, y)):
            with pytest.raises(RuntimeError, match=r"converted after outcore's engine wrapped it .* the engine "
                                                   r"computes in torch.float32 on cpu.*Config\(dtype=...\)"):
                run()
    engine.close()
