"""`outcore export`: a checkpoint, consolidated offline, loads into the plain model with equal logits."""

import os

import pytest
import torch
from safetensors.torch import load_file

import outcore
from outcore.offload import StorageCorruptError
from outcore.tools.cli import main
from outcore.tools.export import export_checkpoint
from outcore.tools.gpt import GPT, PRESETS, init_fn


def _trained_engine(tmp_path, dtype="fp32", **cfg):
    gpt = PRESETS["tiny"]
    with outcore.deferred_init():
        model = GPT(gpt)
    config = outcore.Config(nvme_dir=str(tmp_path / "nvme"), dtype=dtype, sub_group_size=5000, **cfg)
    engine = outcore.Engine(model, config, outcore.AdamW(lr=1e-3), init_fn=init_fn(gpt))
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randint(0, 256, (2, 32), generator=gen)
        engine.backward(engine(x, x))
        engine.step()
    return engine, gpt


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["nvme", "none"])
def test_export_loads_into_the_plain_model_with_equal_logits(tmp_path, offload):
    engine, gpt = _trained_engine(tmp_path, offload_params=offload, offload_optimizer=offload)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            want = engine(x)
        engine.save_checkpoint(str(tmp_path / "ckpt"), "step3")
        live = str(tmp_path / "live.safetensors")
        engine.export(live)
    finally:
        engine.close()
    out = str(tmp_path / "model.safetensors")
    assert main(["export", str(tmp_path / "ckpt"), out]) == 0
    plain = GPT(gpt)
    plain.load_state_dict(load_file(out), strict=True)
    with torch.no_grad():
        assert torch.equal(plain(x), want)
    assert load_file(out).keys() == load_file(live).keys()
    assert all(torch.equal(a, b) for a, b in zip(load_file(out).values(), load_file(live).values(), strict=True))
    assert not [n for n in os.listdir(os.path.dirname(out)) if n.endswith(".tmp")]


@pytest.mark.slow
def test_export_in_bf16_and_of_a_named_tag(tmp_path):
    engine, _ = _trained_engine(tmp_path, dtype="bf16", offload_params="cpu", offload_optimizer="nvme")
    try:
        engine.save_checkpoint(str(tmp_path / "ckpt"), "a")
        engine.backward(engine(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)))
        engine.step()
        engine.save_checkpoint(str(tmp_path / "ckpt"), "b")
        sd_b = engine.full_state_dict()
    finally:
        engine.close()
    a = export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "a.safetensors"), tag="a")
    b = export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "b.safetensors"))  # latest
    assert a["step"] == 3 and b["step"] == 4 and b["dtype"] == "bf16"
    got = load_file(b["out"])
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], v) for k, v in sd_b.items())
    full = export_checkpoint(str(tmp_path / "ckpt" / "b"), str(tmp_path / "b32.safetensors"), dtype="fp32")
    assert load_file(full["out"])["tok.weight"].dtype == torch.float32


def test_damaged_or_missing_checkpoints_are_refused_and_nothing_is_written(tmp_path, capsys):
    engine, _ = _trained_engine(tmp_path)
    try:
        folder = engine.save_checkpoint(str(tmp_path / "ckpt"), "s")
    finally:
        engine.close()
    rank0 = os.path.join(folder, "rank0.safetensors")
    with open(rank0, "r+b") as f:
        f.seek(os.path.getsize(rank0) // 2)
        f.write(b"\x00\x01\x02\x03")
    out = tmp_path / "m.safetensors"
    with pytest.raises(StorageCorruptError, match="rank0.safetensors"):
        export_checkpoint(folder, str(out))
    os.unlink(rank0)
    assert main(["export", folder, str(out)]) == 2
    err = capsys.readouterr().err
    assert "rank0.safetensors" in err and "missing" in err
    assert main(["export", str(tmp_path / "nowhere"), str(out)]) == 2
    assert not out.exists() and not [n for n in os.listdir(out.parent) if n.endswith(".tmp")]


def test_a_train_run_directory_is_refused_naming_its_checkpoints_folder(tmp_path, capsys):
    engine, _ = _trained_engine(tmp_path)
    try:
        engine.save_checkpoint(str(tmp_path / "run" / "checkpoints"), "step3")
    finally:
        engine.close()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "m.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"its checkpoints are in {str(tmp_path / 'run' / 'checkpoints')!r}; point there." in err
    assert not (tmp_path / "m.safetensors").exists()


def test_an_export_into_a_directory_keeps_its_other_files_and_drops_stale_shards(tmp_path, capsys):
    """As `save_pretrained` does: a run directory holding the checkpoint itself and a tokenizer keeps
    both, and a second export with fewer shards leaves none of the first's behind."""
    engine, gpt = _trained_engine(tmp_path)
    run = tmp_path / "run"
    try:
        engine.save_checkpoint(str(run / "checkpoints"), "step3")
        engine.export(str(tmp_path / "live.safetensors"))
    finally:
        engine.close()
    (run / "tokenizer.json").write_text("{}")
    assert main(["export", str(run / "checkpoints"), str(run), "--max-shard-size", "400K"]) == 0
    sharded = sorted(f for f in os.listdir(run) if f.startswith("model"))
    assert len(sharded) > 2 and "model.safetensors.index.json" in sharded
    assert main(["export", str(run / "checkpoints"), str(run)]) == 0  # the checkpoint is still there to read
    assert sorted(os.listdir(run)) == ["checkpoints", "model.safetensors", "tokenizer.json"]
    assert (run / "tokenizer.json").read_text() == "{}"
    live, got = load_file(str(tmp_path / "live.safetensors")), load_file(str(run / "model.safetensors"))
    assert got.keys() <= live.keys() and all(torch.equal(v, live[k]) for k, v in got.items())
    plain = GPT(gpt)
    plain.load_state_dict(got, strict=False)  # the tied head's second name is stored once in a directory
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


@pytest.mark.parametrize("via", ["engine", "offline"])
def test_a_failed_export_leaves_the_earlier_one_as_it_was(tmp_path, monkeypatch, via):
    from outcore.runtime.formats.safetensors_stream import SafetensorsWriter

    engine, _ = _trained_engine(tmp_path)
    out = tmp_path / "m.safetensors"
    try:
        engine.save_checkpoint(str(tmp_path / "ckpt"), "s")
        engine.export(str(out))
        before = out.read_bytes()
        real, calls = SafetensorsWriter.write, []

        def failing(self, name, tensor):
            calls.append(name)
            if len(calls) == 3:
                raise OSError(28, "No space left on device")
            real(self, name, tensor)

        monkeypatch.setattr(SafetensorsWriter, "write", failing)
        with pytest.raises(outcore.StorageError, match="No space left on device. What was written is removed"):
            if via == "engine":
                engine.export(str(out))
            else:
                export_checkpoint(str(tmp_path / "ckpt"), str(out))
    finally:
        engine.close()
    assert out.read_bytes() == before
    assert not [n for n in os.listdir(out.parent) if n.endswith(".tmp")]


@pytest.mark.parametrize("out, words", [("model.bin", "writes safetensors"), ("d.safetensors", "is a directory"),
                                        ("f", "is a file"), ("f/m.safetensors", "f' is a file, not a folder"),
                                        ("f/x/hf", "f' is a file, not a folder")])
def test_an_export_path_it_cannot_become_is_refused_before_anything_is_read(tmp_path, capsys, out, words):
    (tmp_path / "d.safetensors").mkdir()
    (tmp_path / "f").write_text("kept")
    assert main(["export", str(tmp_path / "no-checkpoint-here"), str(tmp_path / out)]) == 2
    err = capsys.readouterr().err
    assert words in err and "no checkpoint" not in err
    assert (tmp_path / "f").read_text() == "kept" and not (tmp_path / "model.bin").exists()


@pytest.mark.parametrize("via", ["engine", "offline"])
def test_a_safetensors_file_in_folders_not_yet_made_is_written_there(tmp_path, capsys, via):
    """As a Hugging Face directory's parents are: before, a FileNotFoundError naming OUT.tmp."""
    engine, _ = _trained_engine(tmp_path)
    out = tmp_path / "new" / "folders" / "model.safetensors"
    if via == "engine":
        engine.export(str(out))
    else:
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        assert main(["export", str(tmp_path / "ckpt"), str(out)]) == 0
    assert load_file(str(out)).keys() == engine.full_state_dict().keys()
    assert os.listdir(out.parent) == ["model.safetensors"]
    engine.close()

