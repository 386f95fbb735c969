"""A LoRA base read where its weights lie (runtime/frozen_in_place.py): trained as the copied base
and plain peft train it, the weights files never written, a file changed during the run refused at
its next read, and checkpoints that refer to the files instead of copying them."""

import json
import os
import shutil

import pytest
import torch
from hf_models import deferred, save_model, token_batches
from safetensors import safe_open
from test_pretrained import HP, assert_close_losses, engine_steps, plain_steps
from transformers import AutoConfig, AutoModelForCausalLM

import outcore
from outcore.offload import Tier
from outcore.offload.file_source import WeightsFileChanged, file_checksum
from outcore.tools.export import export_checkpoint

peft = pytest.importorskip("peft")


def bf16_model(tmp_path) -> str:
    """A tiny Llama saved in bf16 over several files, as most released models are."""
    directory = save_model("llama", str(tmp_path / "m"), max_shard_size="20KB")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    shutil.rmtree(directory)
    model.save_pretrained(directory, max_shard_size="20KB")
    return directory


def weights(directory: str) -> dict[str, tuple[int, str]]:
    """Each weights file's modification time and checksum."""
    return {f: (os.stat(os.path.join(directory, f)).st_mtime_ns, file_checksum(os.path.join(directory, f)))
            for f in sorted(os.listdir(directory)) if f.endswith(".safetensors")}


def lora_engine(directory: str, tmp_path, name: str, params: str = "nvme") -> outcore.Engine:
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    config = outcore.Config(stage=3, offload_params=params, offload_optimizer="nvme", grad_clip=1.0,
                            nvme_dir=str(tmp_path / f"nvme-{name}"))
    return outcore.Engine(peft.get_peft_model(deferred(directory), lora), config, outcore.AdamW(**HP),
                          weights=directory)


def frozen_keys(engine) -> list[str]:
    return [u.param_key for u in engine.units if u.frozen]


def test_a_lora_base_read_in_place_trains_as_the_copied_base_and_peft_and_its_files_are_never_written(tmp_path):
    directory = bf16_model(tmp_path)
    assert len(weights(directory)) > 2
    before = weights(directory)
    engine = lora_engine(directory, tmp_path, "in-place")
    copied = lora_engine(directory, tmp_path, "copied", params="cpu")  # parameters in HOST: the base copied there
    assert all(u.in_place is not None for u in engine.units if u.frozen)
    assert all(u.in_place is None for u in copied.units)
    frozen_bytes = sum(u.layout.shard * 4 for u in engine.units if u.frozen)
    start = engine.full_state_dict()
    ref = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32),
                              peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    ref.load_state_dict({k: v for k, v in start.items() if "lora_" in k}, strict=False)
    assert all(torch.equal(v, start[k]) for k, v in copied.full_state_dict().items())  # one seed: one start
    data = token_batches(4)
    ours = engine_steps(engine, data)
    assert ours == engine_steps(copied, data)
    assert_close_losses(ours, plain_steps(ref, data, clip=1.0))
    s = engine.stats()
    # The swap file holds what trains (the adapters' states and parameters), none of the base.
    assert s["nvme"]["bytes"] < frozen_bytes / 2
    assert not any(engine.store.state.swap.entry(key) for key in frozen_keys(engine))
    for key in frozen_keys(engine):  # each read back from the weights files once evicted
        engine.store.evict(key, Tier.NVME).wait()
    engine.save_checkpoint(str(tmp_path / "ckpt"), "a")
    engine.export(str(tmp_path / "merged"), merge_adapters=True)
    with torch.no_grad():
        engine(input_ids=data[0])
    assert weights(directory) == before
    engine.close()
    copied.close()


@pytest.mark.parametrize("change", ["modified", "replaced"])
def test_a_weights_file_changed_during_the_run_is_refused_at_its_next_read_and_nothing_is_lost(tmp_path, change):
    directory = bf16_model(tmp_path)
    engine = lora_engine(directory, tmp_path, "e")
    data = token_batches(3)
    engine_steps(engine, data[:1])
    adapters = {k: v for k, v in engine.full_state_dict().items() if "lora_" in k}
    for key in frozen_keys(engine):
        engine.store.evict(key, Tier.NVME).wait()
    victim = os.path.join(directory, sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))[0])
    keep = str(tmp_path / "original")
    st = os.stat(victim)
    if change == "modified":
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    else:  # a copy of the same bytes put in its place: another file
        os.replace(victim, keep)
        shutil.copy2(keep, victim)
    with pytest.raises(WeightsFileChanged, match="changed during the run"):
        engine(input_ids=data[1], labels=data[1])
    if change == "modified":  # put back as it was: the run goes on from where it stood
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
        engine_steps(engine, data[1:2])
    else:  # another file, whatever it holds: never read, nor named by a checkpoint as the one trained with
        with pytest.raises(WeightsFileChanged):
            engine(input_ids=data[1], labels=data[1])
        with pytest.raises(WeightsFileChanged, match="a checkpoint would refer to other weights"):
            engine.save_checkpoint(str(tmp_path / "ckpt"), "after")
        assert not os.path.exists(tmp_path / "ckpt" / "after")
        os.replace(keep, victim)  # the very file back: the run goes on
        engine_steps(engine, data[1:2])
    assert all(torch.equal(v, adapters[k]) or "lora_" in k for k, v in engine.full_state_dict().items()
               if k in adapters) and engine.global_step == 2
    engine.close()


def test_a_checkpoint_refers_to_the_weights_files_resumes_from_them_and_refuses_them_changed(tmp_path):
    directory = bf16_model(tmp_path)
    data = token_batches(4)
    engine = lora_engine(directory, tmp_path, "a")
    engine_steps(engine, data[:2])
    folder = engine.save_checkpoint(str(tmp_path / "ckpt"), "step2")
    expected = engine_steps(engine, data[2:])
    trained = engine.full_state_dict()
    engine.close()
    meta = json.load(open(os.path.join(folder, "meta.json")))
    files = {os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors")}
    assert set(meta["weights_files"]) == files
    assert all(u.get("in_place") for u in meta["units"] if u["frozen"])
    with safe_open(os.path.join(folder, "rank0.safetensors"), framework="pt") as f:  # no copy of the base
        assert not [k for k in f.keys() if k.endswith(".param")]

    resumed = lora_engine(directory, tmp_path, "b")
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(u.in_place is not None for u in resumed.units if u.frozen)
    assert engine_steps(resumed, data[2:]) == expected
    resumed.close()

    exported = str(tmp_path / "offline.safetensors")  # `outcore export` reads the base from the files too
    export_checkpoint(str(tmp_path / "ckpt"), exported)
    from safetensors.torch import load_file
    offline = load_file(exported)
    base = {k: v for k, v in trained.items() if "lora_" not in k}
    assert all(torch.equal(offline[k], v) for k, v in base.items() if k in offline)

    victim = sorted(files)[0]
    with open(victim, "r+b") as f:  # one byte of a tensor changed, the size kept
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    fresh = lora_engine(directory, tmp_path, "c")
    with pytest.raises(ValueError, match="no longer holds what it held"):
        fresh.load_checkpoint(str(tmp_path / "ckpt"))
    fresh.close()


@pytest.mark.slow
def test_two_ranks_save_what_one_rank_resumes_from_the_same_weights_files(tmp_path):
    import subprocess

    from dist_in_place_checkpoint import lora_engine as dist_engine
    from launch import torchrun
    from test_multirank import HERE

    directory = bf16_model(tmp_path)
    out = str(tmp_path / "two.json")
    cmd = [*torchrun(2, tmp_path), os.path.join(HERE, "dist_in_place_checkpoint.py"), directory, str(tmp_path / "nvme"),
           str(tmp_path / "ckpt"), out]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    two = json.load(open(out))
    one = dist_engine(directory, str(tmp_path / "nvme-one"))
    one.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(u.in_place is not None for u in one.units if u.frozen)
    for x in token_batches(4, batch=4)[2:]:  # the whole batch, which the two ranks halved
        one.backward(one(input_ids=x, labels=x).loss)
        one.step()
    state = one.full_state_dict()
    for k, v in two["lora"].items():
        torch.testing.assert_close(state[k], torch.tensor(v), rtol=1e-4, atol=1e-6)
    one.close()


def test_a_base_an_adapter_initialization_read_is_copied_and_the_log_says_so_once(tmp_path, caplog):
    directory = bf16_model(tmp_path)
    lora = peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights="pissa", lora_dropout=0.0)
    with outcore.deferred_init():
        model = peft.get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory)), lora)
    config = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "n"))
    with caplog.at_level("WARNING", logger="outcore"):
        engine = outcore.Engine(model, config, weights=directory)
    said = [r.getMessage() for r in caplog.records if "copied into the swap file" in r.getMessage()]
    assert len(said) == 1 and "q_proj" in said[0] and "adapter's initialization" in said[0]
    copied = [u for u in engine.units if u.frozen and u.in_place is None]
    assert len(copied) == 2  # each block's frozen unit holds W - B·A, computed here, for its q_proj
    assert [u for u in engine.units if u.frozen and u.in_place is not None]  # the rest: read in place
    engine.close()
