"""A weights file's safetensors header is checked before any byte of the file is used: a tensor
given too few or too many bytes, a range past the end, two tensors sharing bytes, bytes no tensor
holds, a header that is not one JSON object. Each is refused naming the tensor and the file, as the
safetensors library refuses it; outcore refuses at least every file the library refuses."""

import json
import re
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import outcore
from outcore.runtime.formats.safetensors_header import DTYPE_BYTES, read_header


def write(path, header, data: bytes) -> str:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def the_library_refuses(path: str) -> bool:
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                f.get_tensor(key)
    except Exception:  # noqa: BLE001 - whatever the library raises is its refusal
        return True
    return False


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


ATTACKS = {
    "too few bytes for its shape": ({"w": entry("F32", [2, 2], 0, 12)}, 12, "'w' has 12 bytes where"),
    "cut short, the next tensor's bytes after": ({"w": entry("F32", [4], 0, 8), "b": entry("F32", [2], 8, 16)},
                                                  16, "'w' has 8 bytes where"),
    "F64 declared over F32 bytes": ({"w": entry("F64", [4], 0, 16)}, 16, "'w' has 16 bytes where its shape [4] of F64"),
    "overlapping ranges": ({"w": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, 12, "shares bytes"),
    "past the end of the file": ({"w": entry("F32", [4], 0, 16)}, 8, "lies at bytes [0, 16) of a data section of 8"),
    "bytes no tensor holds": ({"w": entry("F32", [1], 0, 4)}, 8, "belong to no tensor"),
    "an unknown dtype": ({"w": entry("F33", [1], 0, 4)}, 4, "has dtype 'F33'"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_header_that_lies_is_refused_naming_the_tensor_and_the_file(tmp_path, attack):
    header, size, why = ATTACKS[attack]
    path = write(tmp_path / "model.safetensors", header, bytes(size))
    assert the_library_refuses(path)
    with pytest.raises(ValueError, match=re.escape(why)) as e:
        read_header(path)
    assert "model.safetensors" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("raw, why", [(b"[1, 2]", "a JSON list, not an object"),
                                      (b"[" * 5000 + b"]" * 5000, "not JSON"),
                                      (b"{\"__metadata__\": {\"x\": 1}}", "__metadata__ is not an object of strings")])
def test_a_header_that_is_not_one_json_object_is_refused_in_one_line(tmp_path, raw, why):
    with pytest.raises(ValueError, match=why):
        read_header(write(tmp_path / "m.safetensors", raw, b""))


def test_the_engine_refuses_such_weights_before_it_starts(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    good = {k: v.detach() for k, v in model.state_dict().items()}
    save_file(good, str(tmp_path / "good.safetensors"))
    header = {k: entry("F32", list(v.shape), 0, 0) for k, v in good.items()}
    at = 0
    for k, v in good.items():
        n = v.numel() * 4
        header[k] = entry("F32", list(v.shape), at, at + n - 4 if k == "0.weight" else at + n)  # one range short
        at = header[k]["data_offsets"][1]
    bad = write(tmp_path / "bad.safetensors", header, bytes(at))
    with outcore.deferred_init():
        fresh = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    cfg = outcore.Config(offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"))
    with pytest.raises(ValueError, match="'0.weight' has 12 bytes where its shape"):
        outcore.Engine(fresh, cfg, weights=bad)
    assert read_header(str(tmp_path / "good.safetensors")).keys() == good.keys()  # the real thing passes


@settings(max_examples=150, deadline=None)
@given(tensors=st.lists(st.tuples(st.sampled_from(["F32", "F16", "F64", "I8", "BF16"]),
                                  st.lists(st.integers(0, 3), max_size=2),
                                  st.integers(0, 40), st.integers(-8, 8)), min_size=1, max_size=3),
       slack=st.integers(-8, 8))
def test_outcore_refuses_at_least_every_header_the_library_refuses(tmp_path_factory, tensors, slack):
    """Random offsets, lengths, dtypes and overlaps: a file the safetensors library will not read,
    outcore will not either."""
    header, end = {}, 0
    for i, (dtype, shape, begin, error) in enumerate(tensors):
        n = DTYPE_BYTES[dtype]
        for d in shape:
            n *= d
        stop = max(begin, begin + n + error)
        header[f"t{i}"] = entry(dtype, shape, begin, stop)
        end = max(end, stop)
    path = write(tmp_path_factory.mktemp("h") / "x.safetensors", header, bytes(max(0, end + slack)))
    try:
        read_header(path)
        outcore_refuses = False
    except ValueError:
        outcore_refuses = True
    if the_library_refuses(path):
        assert outcore_refuses, header


def test_a_meta_json_of_deeply_nested_brackets_is_a_corrupt_checkpoint_not_a_recursion_error(tmp_path):
    from outcore.offload.errors import CheckpointCorruptError
    from outcore.runtime.checkpoint.folder import read_meta

    (tmp_path / "meta.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(CheckpointCorruptError, match="nests deeper"):
        read_meta(str(tmp_path))
