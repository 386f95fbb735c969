"""An export over an existing folder is replaced whole or not at all: a process killed just before the
swap leaves the old model whole, just after it the new one, never new shards beside an old index. The
user's own files there stay; names the export does not write, and links planted there, are left alone."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import outcore

MODEL = """
import os, signal, sys, torch, outcore
import outcore.runtime.formats.export_target as target
torch.manual_seed(int(sys.argv[2]))
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(8)])
engine = outcore.Engine(model, outcore.Config())
if sys.argv[3] != "none":
    real = target.replace_whole
    def killed(new, old):
        if sys.argv[3] == "after":
            real(new, old)
        os.kill(os.getpid(), signal.SIGKILL)
    target.replace_whole = killed
engine.export(sys.argv[1], max_shard_size=int(sys.argv[4]))
"""


def export(out, seed: int, kill: str = "none", shard: int = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", MODEL, str(out), str(seed), kill, str(shard)], capture_output=True,
                          text=True, timeout=120)


def weights(out) -> dict[str, torch.Tensor]:
    """The folder's model as a loader sees it: through the index when there is one."""
    index = out / "model.safetensors.index.json"
    if not index.exists():
        return load_file(out / "model.safetensors")
    files = set(json.loads(index.read_text())["weight_map"].values())
    return {k: v for f in sorted(files) for k, v in load_file(out / f).items()}


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["before", "after"])
def test_a_kill_at_the_swap_leaves_one_whole_model(tmp_path, kill):
    out = tmp_path / "model"
    assert export(out, seed=1).returncode == 0
    old = weights(out)
    (out / "tokenizer.json").write_text("{}")
    (out / "runs").mkdir()
    (out / "runs" / "notes.txt").write_text("mine")
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) == 8
    assert export(tmp_path / "fresh", seed=2).returncode == 0
    new = weights(tmp_path / "fresh")

    killed = export(out, seed=2, kill=kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    got = weights(out)
    want = old if kill == "before" else new
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert (out / "tokenizer.json").read_text() == "{}" and (out / "runs" / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_an_export_keeps_the_user_s_files_and_drops_the_shards_it_replaces(tmp_path):
    out = tmp_path / "model"
    assert export(out, seed=1).returncode == 0  # 8 shards and an index
    (out / "README.md").write_text("mine")
    (out / "runs").mkdir()
    (out / "runs" / "notes.txt").write_text("mine")
    os.symlink("README.md", out / "link.md")
    inode = os.stat(out / "README.md").st_ino
    result = export(out, seed=2, shard=10**9)  # now one file
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(os.listdir(out)) == ["README.md", "link.md", "model.safetensors", "runs"]
    assert os.stat(out / "README.md").st_ino == inode  # the same file, not a copy
    assert os.readlink(out / "link.md") == "README.md" and (out / "runs" / "notes.txt").read_text() == "mine"
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_names_the_export_does_not_write_are_left_alone(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    engine = outcore.Engine(model, outcore.Config())
    (tmp_path / "model.tmp").mkdir()  # what an older outcore wrote a folder's export under
    (tmp_path / "model.tmp" / "thesis.tex").write_text("mine")
    (tmp_path / "one.safetensors.tmp").write_text("mine")
    precious = tmp_path / "precious.safetensors"
    precious.write_text("mine")
    os.symlink(precious, tmp_path / "one.safetensors")
    engine.export(str(tmp_path / "model"))
    engine.export(str(tmp_path / "one.safetensors"))
    engine.close()
    assert (tmp_path / "model.tmp" / "thesis.tex").read_text() == "mine"
    assert (tmp_path / "one.safetensors.tmp").read_text() == "mine"
    assert precious.read_text() == "mine"  # the link was replaced, not followed
    assert not os.path.islink(tmp_path / "one.safetensors") and "0.weight" in load_file(tmp_path / "one.safetensors")


def test_a_planted_link_is_not_followed_by_the_run_log(tmp_path):
    from outcore.tools.run_log import RunLog

    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    (tmp_path / "out").mkdir()
    os.symlink(precious, tmp_path / "out" / "log.jsonl")
    with pytest.raises(OSError, match="symbolic link"):
        RunLog(str(tmp_path / "out"))
    assert precious.read_text() == "mine"
