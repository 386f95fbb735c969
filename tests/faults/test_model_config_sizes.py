"""Round 4, item 11: a config.json whose sizes are not sizes (a negative width, a million layers, a
string) is one line naming the key, exit 2, at once: not a RuntimeError from torch, not minutes spent
building a million layers on the meta device."""

import json
import os
import sys
import time

import pytest

from outcore.tools.cli import main

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from hf_models import save_model  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_model("llama", str(tmp_path_factory.mktemp("m") / "llama"))


@pytest.mark.parametrize("key, value, said", [
    ("hidden_size", -32, "config.json's hidden_size is -32; a size is a whole number of at least 1"),
    ("num_hidden_layers", 1_000_000, "config.json's num_hidden_layers is 1,000,000, past the 1024 layers"),
    ("vocab_size", "96", "its config.json does not load (Validation error for field 'vocab_size'"),
])
@pytest.mark.parametrize("lora", [[], ["--lora", "4"]], ids=["full", "lora"])
def test_a_config_whose_sizes_are_not_sizes_is_refused_naming_the_key(saved, tmp_path, capsys, key, value, said,
                                                                        lora):
    bad = tmp_path / "bad"
    bad.mkdir()
    json.dump({**json.load(open(os.path.join(saved, "config.json"))), key: value}, open(bad / "config.json", "w"))
    start = time.perf_counter()
    assert main(["estimate", "--model", str(bad), *lora]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err
    assert time.perf_counter() - start < 30
