"""`torch.save` files read for their tensors' byte ranges: the bytes come back equal, and nothing
but a state dict of tensors is ever unpickled."""

import collections
import os
import zipfile

import pytest
import torch

from outcore.runtime.formats.torch_pickle import is_torch_save, tensor_extents
from outcore.runtime.model_family import ModelFamily
from outcore.runtime.pretrained import PretrainedWeights

PLAIN = ModelFamily(torch.nn.Module())  # stored names as they are


def _read_all(path):
    weights = PretrainedWeights(path, PLAIN)
    try:
        return {name: weights.read(stored, stored.dtype) for name, stored in weights.tensors.items()}
    finally:
        weights.close()


def test_every_tensor_reads_back_bit_for_bit_from_its_byte_range(tmp_path):
    grid = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    state = collections.OrderedDict(
        weight=torch.randn(3, 4),
        half=torch.randn(6).bfloat16(),
        ids=torch.arange(7),
        mask=torch.tensor([True, False, True]),
        row=grid[2],  # a view into a shared storage, at an offset
        tied=grid,
        scalar=torch.tensor(2.5, dtype=torch.float64),
        param=torch.nn.Parameter(torch.randn(2, 2)),
    )
    state._metadata = {"": {"version": 1}}  # as module.state_dict() carries
    path = str(tmp_path / "pytorch_model.bin")
    torch.save(state, path)
    assert is_torch_save(path)
    extents = tensor_extents(path)
    assert extents["row"].begin == extents["tied"].begin + 2 * 8 * 4
    back = _read_all(path)
    assert back.keys() == state.keys()
    for name, value in state.items():
        assert back[name].dtype == value.dtype and torch.equal(back[name], value.detach()), name


@pytest.mark.parametrize("content, words", [
    (lambda: {"w": torch.ones(2), "config": {"lr": 1}}, "'config' is a dict, not a tensor"),
    (lambda: {"w": torch.ones(4, 4).t()}, "'w' is a strided view"),
    (lambda: {"layer": torch.nn.Linear(2, 2)}, "pickles torch.nn.modules.linear.Linear"),
    (lambda: [torch.ones(2)], "holds a list, not a state dict"),
])
def test_what_is_not_a_state_dict_of_tensors_is_refused_naming_it(tmp_path, content, words):
    path = str(tmp_path / "pytorch_model.bin")
    torch.save(content(), path)
    with pytest.raises(ValueError, match="cannot stream: .*" + words) as e:
        PretrainedWeights(path, PLAIN)
    assert "\n" not in str(e.value) and "safetensors" in str(e.value)


class _Payload:
    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_an_object_the_pickle_names_is_never_built(tmp_path):
    """torch.load without weights_only would run this payload's os.mkdir."""
    payload = _Payload()
    payload.marker = str(tmp_path / "ran")
    path = str(tmp_path / "pytorch_model.bin")
    torch.save({"w": torch.ones(2), "x": payload}, path)
    with pytest.raises(ValueError, match="pickles posix.mkdir"):
        PretrainedWeights(path, PLAIN)
    assert not os.path.exists(payload.marker)


def test_an_old_pickle_or_a_compressed_archive_is_refused_saying_to_resave(tmp_path):
    old = str(tmp_path / "old.bin")
    torch.save({"w": torch.ones(2)}, old, _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="not in torch.save's zip format .* save it again as safetensors"):
        PretrainedWeights(old, PLAIN)
    plain = str(tmp_path / "plain.bin")
    torch.save({"w": torch.ones(2)}, plain)
    squeezed = str(tmp_path / "squeezed.bin")
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(squeezed, "w", zipfile.ZIP_DEFLATED) as dst:
        for name in src.namelist():
            dst.writestr(name, src.read(name))
    with pytest.raises(ValueError, match="is compressed"):
        PretrainedWeights(squeezed, PLAIN)
