import json
import os

import pytest
import torch
from helpers import HP, train_engine, twins
from models import TinyGPT, batches
from safetensors.torch import load_file

import outcore
from outcore.offload import StorageCorruptError, Tier


def make(tmp_path, name, params="nvme", optim="nvme", **kw):
    cfg = outcore.Config(stage=3, offload_params=params, offload_optimizer=optim,
                         nvme_dir=str(tmp_path / f"nvme-{name}"), sub_group_size=4096, **kw)
    torch.manual_seed(0)
    return outcore.Engine(TinyGPT(), cfg, outcore.AdamW(**HP))


@pytest.mark.parametrize("params, optim, dtype, host", [
    ("nvme", "nvme", "fp32", None), ("none", "none", "fp32", None), ("cpu", "nvme", "fp32", None),
    ("nvme", "nvme", "bf16", None),
    ("nvme", "nvme", "fp32", 64 << 20),  # room for every optimizer state: they stay in HOST, dirty
])
def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, params, optim, dtype, host):
    data = batches(12)
    kw = {"dtype": dtype, "host_budget": host}
    whole, e1 = train_engine(None, None, data, engine=make(tmp_path, "a", params, optim, **kw))
    e1.close()
    first, e2 = train_engine(None, None, data[:7], engine=make(tmp_path, "b", params, optim, **kw))
    assert e2.memory_plan().keeps_optimizer_states(e2.stats()["host"]["budget"]) is (host is not None)
    e2.save_checkpoint(str(tmp_path / "ckpt"), tag="step7")
    e2.close()
    e3 = make(tmp_path, "c", params, optim, **kw)
    meta = e3.load_checkpoint(str(tmp_path / "ckpt"))  # via `latest`
    assert meta["step"] == 7 and meta["tag"] == "step7"
    rest, _ = train_engine(None, None, data[7:], engine=e3)
    assert first + rest == whole, "resumed losses must equal the uninterrupted run's, bit for bit"
    e3.close()


@pytest.mark.parametrize("params", ["nvme", "none"])
def test_fp32_keeps_the_master_once_and_checkpoints_it_whole(tmp_path, params):
    e = make(tmp_path, "a", params, "nvme")
    train_engine(None, None, batches(3), engine=e)
    e.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    e.synchronize()  # (saving waited for the last step's updates already)
    unit = e.units[1]
    chunk = unit.chunks[-1]
    state = e.store.fetch(chunk.opt_key, Tier.HOST).result()
    assert unit.master_is_param and state.numel() == 2 * chunk.numel, "the store holds [m|v]: no master copy"
    m_v = state.clone()
    e.store.release(chunk.opt_key)
    trained = unit.full_values()[chunk.start : chunk.end]
    saved = load_file(str(tmp_path / "ckpt" / "t" / "rank0.safetensors"))[chunk.opt_key]
    assert torch.equal(saved, torch.cat([trained, m_v])), "[master|m|v] per chunk"
    e.close()


def test_checkpoint_layout_is_atomic_and_checksummed(tmp_path):
    e = make(tmp_path, "a", grad_clip=None)
    train_engine(None, None, batches(2), engine=e)
    ckpt = tmp_path / "ckpt"
    e.save_checkpoint(str(ckpt), tag="s1")
    e.save_checkpoint(str(ckpt), tag="s2")
    assert (ckpt / "latest").read_text().strip() == "s2"
    assert sorted(os.listdir(ckpt)) == [".outcore-rank0.lock", "latest", "s1", "s2"], "no temporary folders left"
    meta = json.loads((ckpt / "s2" / "meta.json").read_text())
    assert meta["world_size"] == 1 and meta["step"] == 2 and len(meta["files"]["rank0.safetensors"]) == 8
    blob = bytearray((ckpt / "s2" / "rank0.safetensors").read_bytes())
    blob[-10] ^= 0xFF
    (ckpt / "s2" / "rank0.safetensors").write_bytes(bytes(blob))
    with pytest.raises(StorageCorruptError, match="rank0.safetensors.* is corrupt: its crc32 differs"):
        e.load_checkpoint(str(ckpt), tag="s2")
    os.unlink(ckpt / "s1" / "rank0.safetensors")
    with pytest.raises(ValueError, match="rank0.safetensors.*missing"):
        e.load_checkpoint(str(ckpt), tag="s1")
    with pytest.raises(ValueError, match="no checkpoint in .*nowhere"):
        e.load_checkpoint(str(tmp_path / "nowhere"))
    e.close()


def first_block_frozen(model):
    model.blocks[0].requires_grad_(False)
    return model


@pytest.mark.parametrize("model, difference", [
    (lambda: TinyGPT(layers=2), "the checkpoint's unit 'blocks.2' is not in this model"),
    (lambda: TinyGPT(layers=4), "this model's unit 'blocks.3' is not in the checkpoint"),
    (lambda: TinyGPT(vocab=80), r"tok.weight is \[64, 32\] in the checkpoint and \[80, 32\] in this model"),
    (lambda: first_block_frozen(TinyGPT()),
     r"the checkpoint's unit 'blocks.0' is not in this model, which has 'blocks.0 \(frozen\)'"),
    (lambda: TinyGPT(tied=False),
     r"the checkpoint has tok.weight \(tied to head.weight\) where this model has tok.weight"),
])
def test_a_checkpoint_of_another_model_is_refused_naming_the_difference(tmp_path, model, difference):
    e = make(tmp_path, "a")
    e.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    before = e.full_state_dict()
    e.close()
    other = outcore.Engine(model(), outcore.Config(stage=3, nvme_dir=str(tmp_path / "n2")))
    with pytest.raises(ValueError, match=f"different model or unit split: {difference}. Build the model as it was"):
        other.load_checkpoint(str(tmp_path / "ckpt"))
    other.close()
    again = make(tmp_path, "b")  # the refusal wrote nothing: the checkpoint still loads whole
    again.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(before[k], v) for k, v in again.full_state_dict().items())
    again.close()


def test_adapters_of_a_model_without_any_are_refused_and_nothing_written(tmp_path):
    e = make(tmp_path, "a")
    with pytest.raises(ValueError, match="this TinyGPT is not a peft model, so it has no adapters"):
        e.export(str(tmp_path / "adapters"), adapters_only=True)
    assert not (tmp_path / "adapters").exists()
    e.close()


def test_export_loads_into_a_plain_model_with_equal_logits(tmp_path):
    ours_model, plain = twins(TinyGPT)
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "n"))
    _, e = train_engine(ours_model, cfg, batches(3))
    path = str(tmp_path / "model.safetensors")
    e.export(path)
    sd = load_file(path)
    assert list(sd) == list(plain.state_dict())
    plain.load_state_dict(sd)
    x, y = batches(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(plain(x, y), e(x, y))
    e.close()


@pytest.mark.parametrize("params, optim, dtype", [("none", "none", "fp32"), ("cpu", "cpu", "bf16"),
                                                  ("nvme", "nvme", "fp32")])
def test_a_trained_engine_rolls_back_to_its_checkpoint(tmp_path, params, optim, dtype):
    """Loading over states already in memory overwrites them in place: the derived budgets, sized
    for one copy of the states, hold."""
    e = make(tmp_path, "a", params, optim, dtype=dtype)
    data = batches(4)
    train_engine(None, None, data[:2], engine=e)
    e.save_checkpoint(str(tmp_path / "ckpt"), "t")
    saved = e.full_state_dict()
    train_engine(None, None, data[2:], engine=e)
    assert not torch.equal(e.full_state_dict()["head.weight"], saved["head.weight"])
    e.load_checkpoint(str(tmp_path / "ckpt"))
    after = e.full_state_dict()
    for k, v in saved.items():
        assert torch.equal(after[k], v), k
    e.close()


def test_a_checkpoint_saved_without_a_tag_is_named_by_its_step(tmp_path):
    """As DeepSpeed's `save_checkpoint(dir)`: the tag defaults to `global_step<N>`, and `latest` names it."""
    data = batches(3)
    _, engine = train_engine(None, None, data, engine=make(tmp_path, "a"))
    folder = engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert folder == str(tmp_path / "ckpt" / "global_step3")
    assert open(tmp_path / "ckpt" / "latest").read().strip() == "global_step3"
    weights = engine.full_state_dict()
    engine.close()
    other = make(tmp_path, "b")
    assert other.load_checkpoint(str(tmp_path / "ckpt"))["tag"] == "global_step3"
    for k, v in other.full_state_dict().items():
        assert torch.equal(v, weights[k]), k
    other.close()


def test_a_learning_rate_that_cannot_train_is_refused_and_the_old_one_kept(tmp_path):
    engine = make(tmp_path, "lr", "none", "none")
    for bad in (float("nan"), float("inf"), -1e-3, "1e-3", None):
        with pytest.raises(ValueError, match="engine.lr=.*finite number >= 0"):
            engine.lr = bad
    assert engine.lr == HP["lr"]
    engine.lr = 0  # a frozen step is allowed
    assert engine.lr == 0.0 and isinstance(engine.lr, float)
    engine.close()


@pytest.mark.parametrize("clip", [None, 1.0])  # without clipping the updates ran during backward
def test_saving_between_backward_and_step_is_refused_and_writes_nothing(tmp_path, clip):
    engine = make(tmp_path, "mid", grad_clip=clip)
    data = batches(2)
    engine.backward(engine(*data[0]))
    ckpt = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="before their step\\(\\).*Call engine.step\\(\\) first"):
        engine.save_checkpoint(str(ckpt), tag="mid")
    assert not ckpt.exists()
    engine.step()
    assert engine.save_checkpoint(str(ckpt), tag="after") == str(ckpt / "after")
    engine.close()


def test_a_file_where_the_checkpoint_folder_goes_is_one_clear_error_and_stays(tmp_path):
    engine = make(tmp_path, "file", "none", "none")
    in_the_way = tmp_path / "ckpt"
    in_the_way.write_text("my notes")
    for directory in (in_the_way, in_the_way / "deeper"):
        with pytest.raises(ValueError, match="'.*ckpt' is a file; name a directory"):
            engine.save_checkpoint(str(directory), tag="step1")
    assert in_the_way.read_text() == "my notes"
    engine.close()


def test_the_callers_client_state_comes_back_from_load_and_what_json_cannot_hold_is_refused(tmp_path):
    """As DeepSpeed's save_checkpoint(dir, tag, client_state): the caller's own progress, kept
    with the checkpoint."""
    engine = make(tmp_path, "client", "none", "none")
    data = batches(1)
    engine.backward(engine(*data[0]))
    engine.step()
    ckpt = str(tmp_path / "ckpt")
    for bad, words in (({"rng": torch.get_rng_state()}, "JSON cannot"), ({"loss": float("nan")}, "JSON cannot"),
                       ([1, 2], "client_state is a list")):
        with pytest.raises(ValueError, match=words):
            engine.save_checkpoint(ckpt, tag="bad", client_state=bad)
    assert not os.path.exists(ckpt), "a refused client_state writes nothing"
    state = {"epoch": 2, "batch_in_epoch": 17, "seen": ["a.jsonl"], "schedule": {"warmup": 100}}
    engine.save_checkpoint(ckpt, tag="with", client_state=state)
    engine.save_checkpoint(ckpt, tag="without")
    engine.close()
    other = make(tmp_path, "client2", "none", "none")
    assert other.load_checkpoint(ckpt, tag="with")["client_state"] == state
    assert other.load_checkpoint(ckpt, tag="without")["client_state"] == {}
    other.close()
