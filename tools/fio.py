"""Run fio, when it is on PATH, with the same settings as one of our I/O runs."""

from __future__ import annotations

import json
import shutil
import subprocess


def fio_available() -> bool:
    return shutil.which("fio") is not None


def fio_throughput(path: str, *, write: bool, size: int, block_size: int, queue_depth: int,
                   direct: bool) -> float:
    """Bytes per second of one sequential fio job (libaio, `queue_depth` requests in flight)."""
    cmd = ["fio", "--name=outcore", f"--filename={path}", f"--rw={'write' if write else 'read'}",
           f"--bs={block_size}", f"--size={size}", f"--direct={int(direct)}", "--ioengine=libaio",
           f"--iodepth={queue_depth}", "--numjobs=1", "--output-format=json"]
    if write:
        cmd.append("--end_fsync=1")
    else:
        cmd.append("--invalidate=1")
    return float(_run_job(cmd)["write" if write else "read"]["bw_bytes"])


def fio_mixed_throughput(path: str, *, size: int, block_size: int, queue_depth: int,
                         seconds: float) -> tuple[float, float]:
    """(read, write) bytes per second of one fio job reading and writing at once, half and half,
    sequentially over `path` with O_DIRECT: the mix a step's optimizer stream puts on the disk."""
    cmd = ["fio", "--name=outcore-mixed", f"--filename={path}", "--rw=rw", "--rwmixread=50",
           f"--bs={block_size}", f"--size={size}", "--direct=1", "--ioengine=libaio",
           f"--iodepth={queue_depth}", "--numjobs=1", "--time_based", f"--runtime={seconds:g}",
           "--output-format=json"]
    job = _run_job(cmd)
    return float(job["read"]["bw_bytes"]), float(job["write"]["bw_bytes"])


def _run_job(cmd: list[str]) -> dict:
    """Run one fio job with `--output-format=json` and return its report (fio may print warnings first)."""
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("{"):])["jobs"][0]
