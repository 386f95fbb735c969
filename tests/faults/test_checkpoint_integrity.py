"""A checkpoint's meta.json and `latest` are verified, not trusted: an edit, a foreign format, a
missing file list or a `latest` that points elsewhere is refused by name, on resume and on export."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from models import TinyGPT  # noqa: E402

import outcore  # noqa: E402
from outcore.offload import StorageCorruptError  # noqa: E402
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
