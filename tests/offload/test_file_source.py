"""Keys read from files the store does not own (offload/file_source.py): the bytes and their dtype
conversion, zeros where no span reaches, nothing written, and a file changed under the store refused
at its next read."""

import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from outcore.offload import Tier, TieredStore
from outcore.offload.file_source import FileSource, FileSpan, FileStamp, WeightsFileChanged, file_checksum
from outcore.runtime.formats.safetensors_header import read_header

ST_DTYPE = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}


def weights_file(path, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {"a": torch.randn(300, 7, generator=g).to(torch.bfloat16),
               "b": torch.randn(5000, generator=g),  # fp32: read straight into an fp32 key
               "c": torch.randn(64, generator=g).to(torch.float16)}
    save_file(tensors, str(path))
    return tensors


def spans_of(path, layout: dict[str, int]) -> list[FileSpan]:
    """Each named tensor of the file placed at the given element offset of the key."""
    header = read_header(str(path))
    out = []
    for name, at in layout.items():
        t = header[name]
        dtype = ST_DTYPE[t.dtype]
        out.append(FileSpan(str(path), t.begin, dtype, t.nbytes // dtype.itemsize, at))
    return out


def stamps(*paths) -> dict[str, FileStamp]:
    return {str(p): FileStamp.of(str(p)) for p in paths}


@pytest.fixture
def store(tmp_path):
    s = TieredStore(str(tmp_path / "nvme"), device_budget=1 << 20, host_budget=1 << 20)
    yield s
    s.close()


def test_a_key_reads_its_spans_converted_with_zeros_between_and_nothing_is_written(tmp_path, store):
    path = tmp_path / "w.safetensors"
    tensors = weights_file(path)
    before = (os.stat(path).st_mtime_ns, file_checksum(str(path)))
    layout = {"a": 10, "b": 2200, "c": 7300}  # gaps: [0, 10), [2110, 2200), [7200, 7300) and the tail
    source = FileSource(spans_of(path, layout), 7400, stamps(path))
    for dtype in (torch.float32, torch.bfloat16):
        store.put_source(f"k{dtype}", source, dtype)
        expected = torch.zeros(7400, dtype=dtype)
        for name, at in layout.items():
            expected[at : at + tensors[name].numel()] = tensors[name].reshape(-1).to(dtype)
        for _ in range(3):  # read, dropped from memory without a write, read again
            got = store.fetch_now(f"k{dtype}", Tier.HOST)
            assert torch.equal(got, expected)
            store.release(f"k{dtype}")
            store.evict(f"k{dtype}", Tier.NVME).wait()
    s = store.stats()
    assert s["bytes_written"] == 0 and s["nvme"]["bytes"] == 0
    assert s["bytes_read"] >= 6 * source.nbytes_read
    assert (os.stat(path).st_mtime_ns, file_checksum(str(path))) == before


def test_a_source_key_cannot_be_changed_in_place(tmp_path, store):
    path = tmp_path / "w.safetensors"
    weights_file(path)
    store.put_source("k", FileSource(spans_of(path, {"b": 0}), 5000, stamps(path)), torch.float32)
    store.fetch_now("k", Tier.HOST)
    with pytest.raises(ValueError, match="never changed"):
        store.release("k", dirty=True)
    store.release("k")
    store.put("k", torch.ones(4))  # a new value replaces it, as any put does
    assert torch.equal(store.fetch_now("k", Tier.HOST), torch.ones(4))
    store.release("k")


@pytest.mark.parametrize("change", ["modified", "replaced", "truncated", "removed"])
def test_a_file_changed_after_the_stamp_is_refused_at_the_next_read_and_restored_it_reads_again(tmp_path, store,
                                                                                               change):
    path = tmp_path / "w.safetensors"
    tensors = weights_file(path)
    keep = tmp_path / "original"
    shutil.copy2(path, keep)
    source = FileSource(spans_of(path, {"b": 0}), 5000, stamps(path))
    store.put_source("k", source, torch.float32)
    assert torch.equal(store.fetch_now("k", Tier.HOST), tensors["b"])
    store.release("k")
    store.evict("k", Tier.NVME).wait()
    st = os.stat(path)
    if change == "modified":  # the same size, new bytes
        with open(path, "r+b") as f:
            f.seek(-8, os.SEEK_END)
            f.write(b"\x00" * 8)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    elif change == "replaced":  # the same bytes under another inode, as a copy renamed over it does
        shutil.copy2(keep, tmp_path / "new")
        os.replace(tmp_path / "new", path)
    elif change == "truncated":
        os.truncate(path, st.st_size // 2)
    else:
        os.unlink(path)
    with pytest.raises(WeightsFileChanged, match="w.safetensors"):
        store.fetch_now("k", Tier.HOST)
    if change == "modified":  # the original put back, as it was: read again
        shutil.copy2(keep, path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert torch.equal(store.fetch_now("k", Tier.HOST), tensors["b"])
        store.release("k")


def test_spans_cut_to_a_shard_cover_exactly_its_elements(tmp_path):
    path = tmp_path / "w.safetensors"
    tensors = weights_file(path)
    spans = spans_of(path, {"a": 0, "b": 2100, "c": 7100})
    whole = torch.empty(7200)
    FileSource(spans, 7200, stamps(path)).read_into(whole)
    for lo, hi in ((0, 3600), (3600, 7200), (2000, 2101), (7150, 7200)):
        part = torch.empty(hi - lo)
        FileSource([p for s in spans if (p := s.part(lo, hi, lo)) is not None], hi - lo, stamps(path)).read_into(part)
        assert torch.equal(part, whole[lo:hi])
    assert torch.equal(whole[2100:7100], tensors["b"])


@pytest.mark.parametrize("piece", [64, 100, 4096])
def test_conversions_in_many_pieces_give_every_element(tmp_path, monkeypatch, piece):
    import outcore.offload.file_source as file_source

    monkeypatch.setattr(file_source, "PIECE", piece)  # widened and narrowed a few elements at a time
    path = tmp_path / "w.safetensors"
    tensors = weights_file(path)
    source = FileSource(spans_of(path, {"a": 0, "b": 2100, "c": 7100}), 7200, stamps(path))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = torch.full((7200,), float("nan"), dtype=dtype)
        source.read_into(out)
        stored = [tensors[k].reshape(-1).to(dtype) for k in ("a", "b", "c")]
        expected = torch.cat([*stored, torch.zeros(36, dtype=dtype)])  # the tail no span reaches
        assert torch.equal(out, expected)
