"""`outcore bench-disk`: sequential read and write throughput of a directory, per I/O setting.

Each setting writes a file of `size` bytes through our I/O engine (one `block_size` request at a
time per slot, `queue_depth` slots of page-aligned host memory reused round-robin), fsyncs it, drops
it from the page cache, then reads it back the same way. Where fio is on PATH, fio runs the same
size, block size, queue depth and direct flag (libaio) right after ours, so both see the same disk
weather; `--repeats` interleaves more pairs and reports medians.

Runs without torch: host memory stays the I/O slots plus the interpreter (see [Note: bench memory]).
"""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from outcore.offload.aligned import aligned_array
from outcore.offload.backends import make_engine
from outcore.offload.io_config import IOConfig
from outcore.offload.io_engine import IOFile, IOHandle, open_io_file
from outcore.tools.fio import fio_available, fio_throughput
from outcore.tools.report import peak_rss

# [Note: bench memory] The only large buffers are the slots: queue_depth x block_size bytes. Direct
# I/O bypasses the page cache, so peak RSS ~= interpreter + numpy + slots.


@dataclass(frozen=True, slots=True)
class Setting:
    backend: str
    direct: bool
    block_size: int
    queue_depth: int
    threads: int


@dataclass(slots=True)
class Result:
    setting: Setting
    write_Bps: float
    read_Bps: float
    fio_write_Bps: float | None = None
    fio_read_Bps: float | None = None
    direct_used: bool = True
    write_ratio: float | None = None  # median over repeats of ours / fio measured back to back
    read_ratio: float | None = None

    def as_json(self) -> dict:
        d = asdict(self.setting)
        d.update(write_MBps=self.write_Bps / 1e6, read_MBps=self.read_Bps / 1e6, direct_used=self.direct_used,
                 fio_write_MBps=None if self.fio_write_Bps is None else self.fio_write_Bps / 1e6,
                 fio_read_MBps=None if self.fio_read_Bps is None else self.fio_read_Bps / 1e6,
                 write_ratio=self.write_ratio, read_ratio=self.read_ratio)
        return d


def drop_page_cache(path: str) -> bool:
    """Evict `path` from the page cache; True if the global drop_caches also worked (root only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def _stream(engine, file: IOFile, size: int, slots: list, write: bool) -> float:
    """Move `size` bytes sequentially, keeping every slot busy; returns bytes per second."""
    bs = engine.config.block_size
    pending: list[IOHandle | None] = [None] * len(slots)
    t0 = time.perf_counter()
    for i, off in enumerate(range(0, size, bs)):
        s = i % len(slots)
        previous = pending[s]
        if previous is not None:
            previous.wait()  # this slot's previous request must finish before its buffer is reused
        view = slots[s][: min(bs, size - off)]
        pending[s] = engine.write(file, off, view) if write else engine.read(file, off, view)
    for h in pending:
        if h is not None:
            h.wait()
    if write:
        os.fsync(file.fd)
    return size / (time.perf_counter() - t0)


def lay_out(path: str, size: int) -> None:
    """Write the whole file once, untimed, as fio does: every measured write then overwrites
    written blocks, for ours and fio's alike (first writes into fallocated, unwritten extents cost
    the filesystem extra work that would favour whoever runs second)."""
    chunk = aligned_array(8 << 20)
    chunk[:] = 0x5A
    with open(path, "wb") as f:
        for off in range(0, size, len(chunk)):
            f.write(chunk[: min(len(chunk), size - off)].data)
        f.flush()
        os.fsync(f.fileno())
    drop_page_cache(path)


def measure(path: str, size: int, setting: Setting) -> Result:
    """Write then read `path` with our engine under `setting`."""
    cfg = IOConfig(block_size=setting.block_size, queue_depth=setting.queue_depth, threads=setting.threads,
                   direct=setting.direct, backend=setting.backend, checksum=False)
    slots = [aligned_array(setting.block_size) for _ in range(setting.queue_depth)]
    pattern = os.urandom(setting.block_size)
    for s in slots:
        s[:] = memoryview(pattern)
    file = open_io_file(path, direct=setting.direct, create=False)
    engine = make_engine(cfg)
    try:
        write_bps = _stream(engine, file, size, slots, write=True)
        drop_page_cache(path)
        read_bps = _stream(engine, file, size, slots, write=False)
    finally:
        engine.close()
        file.close()
    return Result(setting, write_bps, read_bps, direct_used=file.direct)


def bench_disk(directory: str, *, size: int, block_sizes: list[int], queue_depths: list[int],
               threads: list[int], backends: list[str], direct: bool = True, repeats: int = 1,
               use_fio: bool = True, progress=None) -> dict:
    """Sweep the settings; returns {"results": [...], "best": ..., "by_block_size": ..., notes}."""
    for bs in block_sizes:
        IOConfig(block_size=bs)  # validates: a multiple of 4096
    if size < max(block_sizes):
        raise ValueError(f"--size {size} is smaller than the largest block size {max(block_sizes)}.")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"--dir {directory!r} is a file; name a directory.")
    try:
        os.makedirs(directory, exist_ok=True)  # a missing one is created, as for every --dir
    except OSError as e:
        raise ValueError(f"--dir {directory!r} cannot be created: {e.strerror}; name another.") from None
    if not os.access(directory, os.W_OK):
        raise ValueError(f"--dir {directory!r} is not writable; name another.")
    free = shutil.disk_usage(directory).free
    if size > free:  # checked first: a file that fills the disk hurts whatever else writes there
        raise ValueError(f"--size {size:,} bytes does not fit in --dir {directory!r}, which has {free:,} bytes "
                         "free; pass a smaller --size or free space there.")
    use_fio = use_fio and fio_available()
    path = os.path.join(directory, f"outcore-bench-{os.getpid()}.dat")
    settings = [Setting(b, direct, bs, qd, th) for b, bs, qd, th
                in itertools.product(backends, block_sizes, queue_depths, threads)]
    fio_keys = sorted({(s.block_size, s.queue_depth) for s in settings})
    steps = repeats * (len(settings) + (len(fio_keys) if use_fio else 0))
    samples: dict[Setting, list[Result]] = {s: [] for s in settings}
    fio_samples: dict[tuple[int, int], list[tuple[float, float]]] = {k: [] for k in fio_keys}
    cache_dropped = True
    try:
        lay_out(path, size)
        for _ in range(repeats):
            for key in fio_keys:  # ours and fio's for the same block size and depth, back to back
                for s in (s for s in settings if (s.block_size, s.queue_depth) == key):
                    samples[s].append(measure(path, size, s))
                    cache_dropped &= drop_page_cache(path)
                    _tick(progress)
                if use_fio:
                    w = fio_throughput(path, write=True, size=size, block_size=key[0], queue_depth=key[1],
                                       direct=direct)
                    r = fio_throughput(path, write=False, size=size, block_size=key[0], queue_depth=key[1],
                                       direct=direct)
                    fio_samples[key].append((w, r))
                    _tick(progress)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    results = []
    for s in settings:
        runs = samples[s]
        res = Result(s, statistics.median(r.write_Bps for r in runs), statistics.median(r.read_Bps for r in runs),
                     direct_used=all(r.direct_used for r in runs))
        if use_fio:
            fio_runs = fio_samples[(s.block_size, s.queue_depth)]
            res.fio_write_Bps = statistics.median(w for w, _ in fio_runs)
            res.fio_read_Bps = statistics.median(r for _, r in fio_runs)
            # The disk's speed drifts between runs: a ratio of neighbours is steadier than one of medians.
            res.write_ratio = statistics.median(o.write_Bps / w for o, (w, _) in zip(runs, fio_runs, strict=True))
            res.read_ratio = statistics.median(o.read_Bps / r for o, (_, r) in zip(runs, fio_runs, strict=True))
        results.append(res)
    return _summarize(results, size=size, repeats=repeats, steps=steps, use_fio=use_fio,
                      cache_dropped=cache_dropped, directory=directory)


def _tick(progress) -> None:
    if progress is not None:
        progress.update(1)


def _summarize(results: list[Result], **facts) -> dict:
    best_w = max(results, key=lambda r: r.write_Bps)
    best_r = max(results, key=lambda r: r.read_Bps)
    by_bs = {}
    for bs in sorted({r.setting.block_size for r in results}):
        rs = [r for r in results if r.setting.block_size == bs]
        w, r = max(rs, key=lambda x: x.write_Bps), max(rs, key=lambda x: x.read_Bps)
        row = {"ours_write_MBps": w.write_Bps / 1e6, "ours_read_MBps": r.read_Bps / 1e6}
        if facts["use_fio"]:
            row["fio_write_MBps"] = max(x.fio_write_Bps or 0.0 for x in rs) / 1e6
            row["fio_read_MBps"] = max(x.fio_read_Bps or 0.0 for x in rs) / 1e6
            row["write_ratio"] = row["ours_write_MBps"] / row["fio_write_MBps"]
            row["read_ratio"] = row["ours_read_MBps"] / row["fio_read_MBps"]
            row["write_ratio_paired"] = max(x.write_ratio or 0.0 for x in rs)
            row["read_ratio_paired"] = max(x.read_ratio or 0.0 for x in rs)
        by_bs[bs] = row
    biggest_slots = max(r.setting.queue_depth * r.setting.block_size for r in results)
    return {"results": [r.as_json() for r in results], "best_write": results.index(best_w),
            "best_read": results.index(best_r), "by_block_size": by_bs, "peak_rss_bytes": peak_rss(),
            "largest_host_buffers_bytes": biggest_slots, "torch_loaded": "torch" in sys.modules, **facts}
