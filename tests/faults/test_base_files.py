"""Round 3, the base a run starts from: no export writes where it lies; `--resume --model OTHER` is
refused where OTHER's bytes differ and accepted where the same base moved; a base file changed in
place with its modification time put back is caught at the next save, not recorded."""

import json
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from hf_models import save_model, save_tokenizer, token_batches  # noqa: E402

from outcore.offload.file_source import WeightsFileChanged, file_checksum  # noqa: E402
from outcore.tools.cli import main  # noqa: E402

peft = pytest.importorskip("peft")
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def _model(tmp_path, name, seed=0):
    directory = save_model("llama", str(tmp_path / name))
    if seed:  # the same shape, other weights
        model = AutoModelForCausalLM.from_pretrained(directory)
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        model.save_pretrained(directory)
    save_tokenizer(directory)
    return directory


@pytest.fixture
def jsonl(tmp_path):
    from hf_models import STORY
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": STORY * 3}) + "\n" for _ in range(40)))
    return str(path)


def _train(tmp_path, model, data, *extra, params="nvme"):
    return main(["train", "--model", model, "--data", data, "--seq", "16", "--batch", "4", "--out",
                 str(tmp_path / "run"), "--offload-params", params, "--offload-optimizer", "nvme", "--dtype", "fp32",
                 "--eval-batches", "1", "--lora", "4", "--json", str(tmp_path / "summary.json"), *extra])


def _checksums(directory):
    return {f: file_checksum(os.path.join(directory, f)) for f in sorted(os.listdir(directory))}


def test_an_export_into_the_base_s_directory_is_refused_and_the_base_kept(tmp_path, jsonl, capsys):
    base = _model(tmp_path, "base")
    assert _train(tmp_path, base, jsonl, "--steps", "2") == 0
    before = _checksums(base)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run" / "checkpoints"), base, "--merge-adapters"]) == 2
    assert "would write where" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run" / "checkpoints"), os.path.join(base, "model.safetensors")]) == 2
    assert _checksums(base) == before
    # and a live engine's export (the Trainer's save_model) into its own base
    from hf_models import deferred

    import outcore
    engine = outcore.Engine(deferred(base), outcore.Config(offload_params="nvme", offload_optimizer="nvme",
                                                            nvme_dir=str(tmp_path / "nvme")), weights=base)
    with pytest.raises(ValueError, match="would write where"):
        engine.export(base)
    engine.close()
    assert _checksums(base) == before


@pytest.mark.parametrize("params", ["nvme", "cpu"])  # the base read in place, or copied into the checkpoint
def test_resume_with_another_base_is_refused_and_a_moved_base_is_taken(tmp_path, jsonl, capsys, params):
    base = _model(tmp_path, "base")
    other = _model(tmp_path, "other", seed=1)  # the same shape, other weights
    assert _train(tmp_path, base, jsonl, "--steps", "2", params=params) == 0
    capsys.readouterr()
    assert _train(tmp_path, other, jsonl, "--steps", "3", "--resume", params=params) == 2
    err = capsys.readouterr().err
    assert "other bytes" in err and base in err and other in err
    moved = str(tmp_path / "moved")
    shutil.move(base, moved)
    assert _train(tmp_path, moved, jsonl, "--steps", "3", "--resume", "--merge-adapters", params=params) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["start_step"] == 2 and len(s["losses"]) == 1
    merged = AutoModelForCausalLM.from_pretrained(s["exported"]).eval()
    by_peft = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(moved),
                                             str(tmp_path / "run" / "adapters")).merge_and_unload().eval()
    x = token_batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, by_peft(x).logits)


def _rewrite_keeping_the_stamp(path):
    st = os.stat(path)
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.seek(st.st_size - 64)
        f.write(bytes(64))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("when", ["before the first save", "between saves"])
def test_a_base_file_changed_with_its_stamp_put_back_is_caught_at_the_next_save(tmp_path, when):
    from hf_models import deferred

    import outcore
    base = _model(tmp_path, "base")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    engine = outcore.Engine(peft.get_peft_model(deferred(base), lora),
                            outcore.Config(offload_params="nvme", offload_optimizer="nvme",
                                           nvme_dir=str(tmp_path / "nvme")), outcore.AdamW(lr=1e-3), weights=base)
    assert any(u.in_place is not None for u in engine.units)
    ckpt = str(tmp_path / "ckpt")
    if when == "between saves":
        engine.save_checkpoint(ckpt, "one")
    _rewrite_keeping_the_stamp(os.path.join(base, "model.safetensors"))
    with pytest.raises(WeightsFileChanged, match="bytes differ from those read at the start"):
        engine.save_checkpoint(ckpt, "two")
    assert not os.path.exists(os.path.join(ckpt, "two"))
    engine.close()
