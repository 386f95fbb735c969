import errno
import logging
import os
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from outcore.offload import Tier, aio_engine, io_engine
from outcore.offload.aligned import aligned_array
from outcore.offload.backends import make_engine
from outcore.offload.buffers import HostBuffer
from outcore.offload.checksum import CHECKSUM_NAME, block_checksum
from outcore.offload.io_config import IOConfig
from outcore.offload.io_engine import ShortIOError, open_io_file
from outcore.offload.swap_file import SwapFile

BACKENDS = ["threads", "aiofiles"]


@pytest.fixture(params=BACKENDS)
def engine(request):
    eng = make_engine(IOConfig(block_size=16 << 10, queue_depth=4, threads=2, backend=request.param))
    yield eng
    eng.close()


@pytest.mark.parametrize("nbytes", [4096, 16 << 10, 5 * 4096 + (16 << 10), 3 << 20])
def test_write_then_read_round_trips_with_block_checksums(engine, tmp_path, nbytes):
    f = open_io_file(str(tmp_path / "f"), direct=True)
    try:
        src = HostBuffer(nbytes)
        src.array[:] = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
        w = engine.write(f, 8192, src.array, checksum=True)
        w.wait()
        dst = HostBuffer(nbytes)
        r = engine.read(f, 8192, dst.array, checksum=True)
        r.wait()
        assert np.array_equal(src.array, dst.array)
        bs = engine.config.block_size
        assert w.crcs == r.crcs == [block_checksum(src.array[i:i + bs]) for i in range(0, nbytes, bs)]
        assert engine.counters.bytes_read == nbytes and engine.counters.bytes_written == nbytes
    finally:
        f.close()


def test_the_disk_busy_time_leaves_the_checksums_out(engine, tmp_path, monkeypatch):
    """`io_busy_seconds` is the disk's time (a benchmark divides the bytes by it); a block's
    checksum is CPU work beside the read or write call, so a slow one adds nothing to it."""
    def slow_checksum(view):
        time.sleep(0.5)
        return block_checksum(view)

    for module in (io_engine, aio_engine):
        monkeypatch.setattr(module, "block_checksum", slow_checksum)
    f = open_io_file(str(tmp_path / "f"), direct=True)
    try:
        buf = HostBuffer(4096)
        buf.array[:] = 7
        w = engine.write(f, 0, buf.array, checksum=True)
        w.wait()
        r = engine.read(f, 0, buf.array, checksum=True)
        r.wait()
        assert w.crcs == r.crcs == [block_checksum(buf.array)]
        assert 0 < engine.counters.snapshot()["io_busy_seconds"] < 0.5  # two 4 KiB calls, two 0.5 s checksums
    finally:
        f.close()


def test_reading_past_the_end_is_a_short_read(engine, tmp_path):
    f = open_io_file(str(tmp_path / "f"), direct=True)
    try:
        buf = HostBuffer(4 * 4096)
        engine.write(f, 0, buf.array[:4096]).wait()
        with pytest.raises(ShortIOError):
            engine.read(f, 0, buf.array).wait()
    finally:
        f.close()


def test_many_requests_in_flight_complete_independently(engine, tmp_path):
    f = open_io_file(str(tmp_path / "f"), direct=True)
    try:
        bufs = [HostBuffer(64 << 10) for _ in range(16)]
        for i, b in enumerate(bufs):
            b.array[:] = i
        handles = [engine.write(f, i * (64 << 10), b.array) for i, b in enumerate(bufs)]
        for h in handles:
            h.wait()
        out = HostBuffer(16 * (64 << 10))
        engine.read(f, 0, out.array).wait()
        assert all((out.array[i * (64 << 10):(i + 1) * (64 << 10)] == i).all() for i in range(16))
    finally:
        f.close()


def test_buffered_fallback_when_o_direct_is_refused(tmp_path, monkeypatch, caplog):
    def refuse(path, flags):
        raise OSError(errno.EINVAL, "Invalid argument")  # what tmpfs answers on older kernels

    monkeypatch.setattr(io_engine, "_open_direct", refuse)
    monkeypatch.setattr(io_engine, "_warned_buffered", set())
    with caplog.at_level(logging.WARNING):
        a = open_io_file(str(tmp_path / "a"), direct=True)
        b = open_io_file(str(tmp_path / "b"), direct=True)
    assert not a.direct and not b.direct
    assert sum("O_DIRECT is not supported" in r.message for r in caplog.records) == 1, "said once"
    a.close()
    b.close()


def test_direct_io_on_the_real_disk_and_on_tmpfs(tmp_path):
    f = open_io_file(str(tmp_path / "f"), direct=True)
    assert f.direct, "ext4 and xfs accept O_DIRECT"
    f.close()
    if os.path.isdir("/dev/shm"):
        g = open_io_file(f"/dev/shm/outcore-test-{os.getpid()}", direct=True)
        try:
            eng = make_engine(IOConfig(block_size=4096, queue_depth=2, threads=1))
            buf = HostBuffer(4096)
            buf.array[:] = 3
            eng.write(g, 0, buf.array).wait()
            buf.array[:] = 0
            eng.read(g, 0, buf.array).wait()
            assert (buf.array == 3).all()
            eng.close()
        finally:
            g.close()
            os.unlink(g.path)


def test_block_checksum_is_the_standard_crc():
    # The check values of the two algorithms over b"123456789" (CRC catalogue).
    expected = {"crc32c": 0xE3069283, "crc32": 0xCBF43926}[CHECKSUM_NAME]
    assert block_checksum(b"123456789") == expected
    assert CHECKSUM_NAME == "crc32c", "the crc32c package (a dependency) should give hardware CRC-32C here"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
@pytest.mark.parametrize("backend", ["threads", "aiofiles"])
def test_background_threads_run_below_the_callers_priority(make_store, backend):
    store = make_store(io=IOConfig(block_size=8 << 10, threads=2, backend=backend, nice=7))
    store.put("k", torch.arange(50_000, dtype=torch.float32), Tier.NVME).wait()
    assert torch.equal(store.fetch("k", Tier.DEVICE).result(), torch.arange(50_000, dtype=torch.float32))
    mine = os.getpriority(os.PRIO_PROCESS, os.getpid())
    workers = {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threading.enumerate()
               if t.name.startswith("outcore-") and t.native_id is not None}
    # I/O workers (those the aiofiles loop starts too), the writer and the movers yield to compute
    assert any(n.startswith(("outcore-io", "outcore-aio")) for n in workers), workers
    assert {"outcore-writer"} <= set(workers) and any(n.startswith("outcore-move") for n in workers), workers
    assert set(workers.values()) == {min(19, mine + 7)}, workers


def test_nice_outside_0_to_19_is_refused():
    with pytest.raises(ValueError, match="io.nice=20"):
        IOConfig(nice=20)


def test_a_finished_request_keeps_no_reference_to_its_buffer(engine, tmp_path):
    # A buffer the pool drops must be unmapped then, not whenever a worker takes its next block:
    # neither the workers nor a completed handle (which the caller may keep) hold a view of it.
    swap = SwapFile(str(tmp_path / "nvme"), 0, engine)
    try:
        for op in ("write", "read"):
            buf = aligned_array(3 << 20)
            gone = weakref.ref(buf)
            handle = (swap.write("k", buf, len(buf), torch.uint8, (len(buf),)) if op == "write"
                      else swap.read("k", buf))
            handle.wait()
            del buf
            deadline = time.monotonic() + 5  # the worker drops its block just after completing it
            while gone() is not None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert gone() is None, f"a finished {op} still holds its buffer"
            assert handle.done()
    finally:
        swap.close(remove=True)


def test_a_read_waits_neither_behind_queued_writes_nor_for_their_slots(tmp_path, monkeypatch, held_writes):
    # [Note: reads first] One worker, held inside a write; queue_depth 2 leaves writes one slot.
    real_read = io_engine._pread_full

    def read(fd, view, offset):
        held_writes.order.append(("read", offset))
        real_read(fd, view, offset)

    monkeypatch.setattr(io_engine, "_pread_full", read)
    eng = make_engine(IOConfig(block_size=4096, queue_depth=2, threads=1))
    f = open_io_file(str(tmp_path / "f"), direct=True)
    try:
        os.ftruncate(f.fd, 16 * 4096)
        bufs = [HostBuffer(4096) for _ in range(3)]
        held_writes.hold()
        first = eng.write(f, 0, bufs[0].array)
        assert held_writes.writing.wait(10)
        second = []
        queued_write = threading.Thread(target=lambda: second.append(eng.write(f, 4096, bufs[1].array)), daemon=True)
        queued_write.start()  # waits for the one write slot
        got = []
        reader = threading.Thread(target=lambda: got.append(eng.read(f, 8 * 4096, bufs[2].array)), daemon=True)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), "the read waited for a slot the writes hold"
        held_writes.release()
        for h in [first, got[0]]:
            h.wait()
        queued_write.join(10)
        second[0].wait()
        assert held_writes.order == [("write", 0), ("read", 8 * 4096), ("write", 4096)]
    finally:
        held_writes.release()
        eng.close()
        f.close()
