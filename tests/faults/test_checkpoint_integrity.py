"""A checkpoint's meta.json and `latest` are verified, not trusted: an edit, a foreign format, a
missing file list or a `latest` that points elsewhere is refused by name, on resume and on export.
A crash at any instant of a save leaves a checkpoint that resume finds; `train --tag` picks one."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from models import TinyGPT  # noqa: E402

import outcore  # noqa: E402
from outcore.offload import StorageCorruptError  # noqa: E402
from outcore.tools.cli import main  # noqa: E402
from outcore.tools.export import export_checkpoint  # noqa: E402


@pytest.fixture
def checkpoint(tmp_path):
    engine = outcore.Engine(TinyGPT(), outcore.Config(nvme_dir=str(tmp_path / "n")))
    engine.save_checkpoint(str(tmp_path / "ckpt"), "t")
    engine.close()
    return tmp_path / "ckpt"


def resume(tmp_path, ckpt):
    engine = outcore.Engine(TinyGPT(), outcore.Config(nvme_dir=str(tmp_path / "m")))
    try:
        engine.load_checkpoint(str(ckpt))
    finally:
        engine.close()


def edit(ckpt, change):
    path = ckpt / "t" / "meta.json"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize(("change", "error", "message"), [
    (lambda m: m.update(step=m["step"] + 10), StorageCorruptError, "checksum does not match"),
    (lambda m: m["unit_steps"].__setitem__(0, 7), StorageCorruptError, "checksum does not match"),
    (lambda m: m["units"][0].__setitem__("shard", 1), StorageCorruptError, "checksum does not match"),
    (lambda m: m.update(format=99), ValueError, "format 99"),
    (lambda m: m.update(files={}), StorageCorruptError, "checksum does not match"),
])
def test_an_edited_meta_json_is_refused_on_resume_and_export(tmp_path, checkpoint, change, error, message):
    edit(checkpoint, change)
    with pytest.raises(error, match=message):
        resume(tmp_path, checkpoint)
    with pytest.raises(error, match=message):
        export_checkpoint(str(checkpoint), str(tmp_path / "out.safetensors"))
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("latest", ["/etc", "../elsewhere", ".t.tmp", ""])
def test_latest_must_be_a_bare_tag(tmp_path, checkpoint, latest):
    (checkpoint / "latest").write_text(latest + "\n")
    with pytest.raises(StorageCorruptError, match="not a bare tag name"):
        resume(tmp_path, checkpoint)


def test_an_untouched_checkpoint_still_loads(tmp_path, checkpoint):
    resume(tmp_path, checkpoint)


CRASHES = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, sys.argv[3])
    from models import TinyGPT
    import outcore
    ckpt, when = sys.argv[1], sys.argv[2]
    engine = outcore.Engine(TinyGPT(), outcore.Config())
    if when == "resave":  # a first save of "t" at step 0, then one step and the re-save of "t" dies
        engine.save_checkpoint(ckpt, "t")
    x = torch.randint(0, 64, (2, 16))
    engine.backward(engine(x, x))
    engine.step()
    real = os.replace
    def dies(src, dst):  # kill -9 at the instant of the rename named by `when`
        if (when == "resave" and "/.t." in src) or (when == "first" and dst.endswith("latest")):
            os.kill(os.getpid(), signal.SIGKILL)
        real(src, dst)
    os.replace = dies
    engine.save_checkpoint(ckpt, "t")
""")


def _crash(tmp_path, when):
    ckpt = tmp_path / "ckpt"
    models = os.path.join(os.path.dirname(__file__), "..", "runtime")
    res = subprocess.run([sys.executable, "-c", CRASHES, str(ckpt), when, models], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    return ckpt


@pytest.mark.slow
def test_a_crash_while_resaving_a_tag_resumes_from_its_previous_save(tmp_path, caplog):
    """Row 10: killed between moving the old folder aside and the new one into place, `latest` names
    a tag whose folder is gone; its previous save stands in for it."""
    ckpt = _crash(tmp_path, "resave")
    assert not (ckpt / "t").exists() and (ckpt / ".t.old").exists() and (ckpt / "latest").read_text() == "t\n"
    engine = outcore.Engine(TinyGPT(), outcore.Config())
    with caplog.at_level(logging.WARNING):
        meta = engine.load_checkpoint(str(ckpt))
    engine.close()
    assert meta["step"] == 0 and any("stands in" in r.message for r in caplog.records)


@pytest.mark.slow
def test_a_first_checkpoint_saved_before_latest_is_found(tmp_path, capsys):
    """Row 10: killed after the first save's folder was in place, before `latest` was written."""
    ckpt = _crash(tmp_path, "first")
    assert (ckpt / "t").exists() and not (ckpt / "latest").exists()
    engine = outcore.Engine(TinyGPT(), outcore.Config())
    assert engine.load_checkpoint(str(ckpt))["step"] == 1
    engine.close()


def test_train_resumes_from_the_tag_it_is_given(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    base = ["train", "--batch", "1", "--seq", "16", "--eval-batches", "1", "--save-every", "2"]
    assert main([*base, "--steps", "4"]) == 0
    assert main([*base, "--steps", "5", "--resume", "--tag", "step2"]) == 0
    out = capsys.readouterr().out
    assert "resumed from outcore-run/checkpoints/step2 at step 2" in out
    assert main([*base, "--steps", "5", "--resume", "--tag", "step3"]) == 2
    assert "step3" in capsys.readouterr().err and main([*base, "--tag", "step2"]) == 2


@pytest.mark.parametrize("name, content, message", [
    ("meta.json", b"\xff\xfe{}", "is not UTF-8 text"), ("meta.json", b"[1, 2]", "holds a JSON list, not an object"),
    ("latest", b"\xff\xfe", "is not UTF-8 text"),
])
def test_an_unreadable_meta_or_latest_is_named(tmp_path, checkpoint, name, content, message):
    path = checkpoint / "t" / name if name == "meta.json" else checkpoint / name
    path.write_bytes(content)
    with pytest.raises(outcore.CheckpointCorruptError) as e:
        resume(tmp_path, checkpoint)
    assert f"checkpoint file {str(path)!r} is corrupt: it {message}" in str(e.value)


def test_a_corrupt_rank_file_blames_the_checkpoint_not_the_swap_file(tmp_path, checkpoint):
    path = checkpoint / "t" / "rank0.safetensors"
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0x55
    path.write_bytes(bytes(blob))
    with pytest.raises(outcore.CheckpointCorruptError) as e:
        resume(tmp_path, checkpoint)
    assert str(path) in str(e.value) and "swap" not in str(e.value) and "--tag" in str(e.value)
