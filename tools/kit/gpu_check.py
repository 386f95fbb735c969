"""The GPU kit: what a GPU owner runs once, in about 15 minutes, to check outcore on their machine.

    python -m outcore.tools.kit.gpu_check [--out gpu_check.json] [--nvme-dir DIR] [--quick]

1. the `cuda`-marked tests (`pytest -m cuda`, where the repository's tests are beside the package);
2. parity on the GPU: a small GPT trained by the engine against plain PyTorch, fp32 and bf16, for
   every stage and offload setting the engine accepts;
3. overlap: a host-to-device copy on the store's side stream, from pinned memory, timed with CUDA
   events against a matmul on the default stream; overlapped, the two take less than their sum;
4. the disk: sequential write and read of `--nvme-dir` with the store's default I/O settings (and
   fio's, where installed), what the NVMe run's bytes per step are measured against;
5. throughput: tokens/s, model TFLOPS and MFU (against the dense bf16 matmul rate measured here)
   for a GPT of about 1.3B parameters with parameters and optimizer states on NVMe, and for the
   largest preset whose states fit this machine's memory;
6. real shapes (not with --quick): a Llama-8B-shaped full fine-tune and a Qwen-14B-shaped LoRA with
   its base on NVMe under a 16 GiB device budget, each beside the step estimate's prediction
   (tools/kit/gpu_shapes.py).
Everything goes into one JSON file, written again after each part: a part that fails is recorded
there (its error and traceback) and the kit goes on with the next, since the first run on a new
machine is when things break and the JSON is what comes back. On a machine without CUDA it says
so, writes that, and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from outcore.runtime.sizes import human_bytes, human_count
from outcore.tools.kit.gpu_shapes import SHAPES, deepspeed_note
from outcore.tools.report import check_json_argument

PARITY_SETTINGS = [(1, "none", "none"), (1, "none", "cpu"), (2, "none", "cpu"), (2, "none", "nvme"),
                   (3, "none", "none"), (3, "cpu", "cpu"), (3, "nvme", "nvme"), (3, "none", "nvme")]
TOLERANCE = {"fp32": 1e-3, "bf16": 3e-2}  # relative, on the losses (GPU kernels reorder sums)
CUDA_TESTS_TIMEOUT = 300  # seconds: the whole kit is meant to take under 10 minutes


def run_cuda_tests() -> dict:
    """`pytest -m cuda` over the repository's tests, where they are beside the package."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/kit/ in the root
    tests = os.path.join(root, "tests")
    if not os.path.isdir(tests):
        return {"ran": False, "why": f"no tests folder at {tests} (an installed package): run from a checkout"}
    t0 = time.perf_counter()
    try:
        # a test module that another machine's packages cannot import must not hide the cuda tests
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
                              "--continue-on-collection-errors", "--tb=short", "--show-capture=no", tests], cwd=root,
                             capture_output=True, text=True, timeout=CUDA_TESTS_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        tail = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"ran": True, "ok": False, "summary": f"timed out after {CUDA_TESTS_TIMEOUT} s",
                "seconds": time.perf_counter() - t0, "output_tail": tail[-3000:]}
    summary = (res.stdout.strip().splitlines() or [""])[-1]
    return {"ran": True, "ok": res.returncode == 0, "summary": summary, "seconds": time.perf_counter() - t0,
            "output_tail": res.stdout[-6000:] if res.returncode else ""}


def parity(device: torch.device, nvme_dir: str, *, steps: int = 4,
           settings: list[tuple[int, str, str]] = PARITY_SETTINGS, dtypes: tuple[str, ...] = ("fp32", "bf16")) -> list:
    """Losses of a small GPT, the engine against plain PyTorch (same init and data), per setting."""
    from outcore import runtime
    from outcore.tools.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab=512, seq=64, layers=4, d_model=128, heads=4, tied=False)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab, (4, cfg.seq + 1), generator=g) for _ in range(steps)]
    out = []
    for dtype in dtypes:
        amp = torch.bfloat16 if dtype == "bf16" else None
        torch.manual_seed(0)
        plain = GPT(cfg).to(device)
        start = {k: v.detach().clone() for k, v in plain.state_dict().items()}
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        ref = []
        for t in data:
            t = t.to(device)
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                loss = plain(t[:, :-1], t[:, 1:])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
            opt.step()
            ref.append(float(loss.detach()))
        for stage, params, optim in settings:
            model = GPT(cfg)
            model.load_state_dict({k: v.cpu() for k, v in start.items()})
            with tempfile.TemporaryDirectory(dir=nvme_dir) as d:
                conf = runtime.Config(stage=stage, offload_params=params, offload_optimizer=optim, nvme_dir=d,
                                      dtype=dtype, grad_clip=1.0)
                engine = runtime.Engine(model, conf, runtime.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1),
                                        device=device)
                ours = []
                for t in data:
                    t = t.to(device)
                    loss = engine(t[:, :-1], t[:, 1:])
                    engine.backward(loss)
                    engine.step()
                    ours.append(float(loss.detach()))
                engine.close()
            worst = max(abs(a - b) / abs(b) for a, b in zip(ours, ref, strict=True))
            out.append({"dtype": dtype, "stage": stage, "offload_params": params, "offload_optimizer": optim,
                        "losses": ours, "reference": ref, "worst_relative": worst, "ok": worst <= TOLERANCE[dtype]})
    return out


def copy_overlap(device: torch.device, nbytes: int = 256 << 20) -> dict:
    """A pinned host-to-device copy on the store's side stream against a matmul on the default
    stream: each alone, then both at once (CUDA events). `overlap` is the share of the shorter one
    hidden behind the other (1.0: fully)."""
    from outcore.offload.buffers import HostBuffer
    from outcore.offload.device_memory import CudaMemory

    mem = CudaMemory(2 * nbytes, device)
    src = HostBuffer(nbytes, pin=True)
    dst = mem.try_acquire(nbytes)
    assert dst is not None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def matmuls() -> None:
        for _ in range(8):
            a @ a

    def timed(work) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        work()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3

    def copy() -> None:
        with torch.cuda.stream(mem.stream):
            dst.tensor[:nbytes].copy_(src.tensor[:nbytes], non_blocking=True)
        torch.cuda.current_stream(device).wait_stream(mem.stream)

    matmuls()
    copy()  # warm both up
    t_mm, t_copy = timed(matmuls), timed(copy)

    def both() -> None:
        with torch.cuda.stream(mem.stream):
            dst.tensor[:nbytes].copy_(src.tensor[:nbytes], non_blocking=True)
        matmuls()
        torch.cuda.current_stream(device).wait_stream(mem.stream)

    t_both = timed(both)
    pinned = src.pinned
    mem.release(dst)
    src.free()
    hidden = (t_mm + t_copy - t_both) / min(t_mm, t_copy)
    return {"pinned": pinned, "copy_s": t_copy, "copy_GBps": nbytes / t_copy / 1e9, "matmul_s": t_mm,
            "both_s": t_both, "overlap": max(0.0, min(1.0, hidden)), "ok": pinned and hidden > 0.5}


def disk(nvme_dir: str, size: int = 2 << 30) -> dict:
    """Sequential GB/s of `nvme_dir` through the store's I/O engine at its default settings, and
    fio's beside it where fio is installed (None otherwise)."""
    from outcore.offload.io_config import IOConfig
    from outcore.tools.bench_disk import bench_disk

    io = IOConfig()
    got = bench_disk(nvme_dir, size=size, block_sizes=[io.block_size], queue_depths=[io.queue_depth],
                     threads=[io.threads], backends=[io.backend], direct=io.direct)
    row = got["by_block_size"][io.block_size]
    return {"bytes": size, "write_GBps": row["ours_write_MBps"] / 1e3, "read_GBps": row["ours_read_MBps"] / 1e3,
            "fio_write_GBps": row["fio_write_MBps"] / 1e3 if got["use_fio"] else None,
            "fio_read_GBps": row["fio_read_MBps"] / 1e3 if got["use_fio"] else None,
            "direct": got["results"][0]["direct_used"]}


def matmul_peak(device: torch.device, n: int = 8192, repeats: int = 20) -> float:
    """Dense bf16 matmul FLOP/s measured here: the denominator of MFU."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ a
    torch.cuda.synchronize(device)
    return 2 * n**3 * repeats / (time.perf_counter() - t0)


def throughput(device: torch.device, preset: str, nvme_dir: str, *, offload: str, steps: int, batch: int,
               peak: float) -> dict:
    """Tokens/s, model TFLOPS (6 N + attention per token, as the PaLM paper counts) and MFU."""
    from outcore import runtime
    from outcore.runtime.materialize import deferred_init
    from outcore.tools.gpt import GPT, PRESETS, init_fn

    cfg = PRESETS[preset]
    with deferred_init():
        model = GPT(cfg, checkpoint_activations=True)
    with tempfile.TemporaryDirectory(dir=nvme_dir) as d:
        conf = runtime.Config(stage=3, offload_params=offload, offload_optimizer=offload, nvme_dir=d, dtype="bf16",
                              grad_clip=None)
        engine = runtime.Engine(model, conf, runtime.AdamW(lr=1e-4), init_fn=init_fn(cfg), device=device)
        g = torch.Generator().manual_seed(0)
        times = []
        if device.type == "cuda":  # this run's peak, not an earlier part's
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(steps + 1):
            t = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g).to(device)
            _synchronize(device)
            t0 = time.perf_counter()
            engine.backward(engine(t[:, :-1], t[:, 1:]))
            engine.step()
            engine.synchronize()
            _synchronize(device)
            if i:  # the first step records the unit order
                times.append(time.perf_counter() - t0)
        stats = engine.stats()
        engine.close()
    step = sorted(times)[len(times) // 2]
    tokens = batch * cfg.seq
    flops_per_token = 6 * cfg.params + 12 * cfg.layers * cfg.d_model * cfg.seq
    achieved = flops_per_token * tokens / step
    return {"preset": preset, "params": cfg.params, "offload": offload, "batch": batch, "seq": cfg.seq,
            "step_s": step, "tokens_per_s": tokens / step, "model_TFLOPS": achieved / 1e12, "MFU": achieved / peak,
            "gpu_peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "bytes_read": stats["bytes_read"], "bytes_written": stats["bytes_written"],
            "io_busy_seconds": stats["io_busy_seconds"]}


def shape_row(row: str, nvme_dir: str, *, peak: float, disk: dict, overlap: dict | None, batch: int = 1,
              seq: int = 2048, steps: int = 2, timeout: float = 420) -> dict:
    """One real-shape row (tools/kit/gpu_shapes.py) in a process of its own, with the rates this kit
    measured (the compute rate on the row's own width)."""
    from outcore.tools import machine_rates

    width = SHAPES[row].config["hidden_size"]
    seq = SHAPES[row].seq or seq  # a long-context row's own, and a step of minutes
    timeout = max(timeout, 1800) if SHAPES[row].long_context else timeout
    rates = {"disk_read": disk["read_GBps"] * 1e9, "disk_write": disk["write_GBps"] * 1e9,
             "flops": machine_rates.measure_flops("cuda", "bf16", tokens=batch * seq, d_model=width),
             "adam": machine_rates.measure_adam(),
             "host_device": (overlap or {}).get("copy_GBps", 25.0) * 1e9, "peak_flops": peak}
    spec = {"device": "cuda", "nvme_dir": nvme_dir, "rates": rates, "batch": batch, "seq": seq, "steps": steps}
    res = subprocess.run([sys.executable, "-m", "outcore.tools.kit.gpu_shapes", row, json.dumps(spec)],
                         capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{row} failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def largest_fitting(memory_bytes: int) -> str:
    """The largest GPT preset whose bf16 weights, fp32 master and Adam states (18 B a parameter)
    fit in half of `memory_bytes`."""
    from outcore.tools.presets import PRESETS

    fitting = [(cfg.params, name) for name, cfg in PRESETS.items()
               if not name.startswith("bench") and 18 * cfg.params <= memory_bytes // 2]
    return max(fitting)[1] if fitting else "tiny"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m outcore.tools.kit.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", "--out", dest="out", metavar="PATH", default="gpu_check.json",
                   help="the one JSON file of every result, written as each part ends (default: gpu_check.json)")
    p.add_argument("--nvme-dir", default=".", help="where the NVMe runs put their swap files")
    p.add_argument("--quick", action="store_true", help="fewer steps, the 1.3B run only, no real shapes")
    args = p.parse_args(argv)
    check_json_argument(p, args.out)
    result: dict[str, Any] = {"cuda": torch.cuda.is_available(), "torch": torch.__version__}
    if not result["cuda"]:
        print("gpu_check: torch sees no CUDA GPU here; nothing to check (wrote that to " + args.out + ")")
        _write(args.out, result)
        return 0
    import psutil

    device = torch.device("cuda", 0)
    result["device"] = torch.cuda.get_device_name(device)
    os.makedirs(args.nvme_dir, exist_ok=True)
    t0 = time.perf_counter()
    print(f"gpu_check on {result['device']}", flush=True)

    def part(name: str, work: Callable[[], Any], into: dict | None = None) -> Any:
        return run_part(result, name, work, args.out, into=into)

    tests = part("cuda_tests", run_cuda_tests)
    if tests is not None:
        print(f"  cuda tests: {tests.get('summary', tests.get('why'))}", flush=True)
    rows = part("parity", lambda: parity(device, args.nvme_dir))
    if rows is not None:
        bad = [r for r in rows if not r["ok"]]
        print(f"  parity: {len(rows) - len(bad)}/{len(rows)} settings within tolerance", flush=True)
    overlap = part("overlap", lambda: copy_overlap(device))
    if overlap is not None:
        print(f"  side-stream copy: {overlap['copy_GBps']:.1f} GB/s, {overlap['overlap']:.0%} hidden behind matmuls",
              flush=True)
    peak = part("matmul_peak_TFLOPS", lambda: matmul_peak(device) / 1e12)
    io = part("disk", lambda: disk(args.nvme_dir))
    if io is not None:
        print(f"  disk at {args.nvme_dir}: write {io['write_GBps']:.2f} GB/s, read {io['read_GBps']:.2f} GB/s",
              flush=True)
    steps = 2 if args.quick else 4
    runs = [("gpt-1b", "nvme")]  # about 1.3B parameters with the 32,000-row embedding
    if not args.quick:
        runs.append((largest_fitting(psutil.virtual_memory().total), "cpu"))
    result["throughput"] = {}
    for preset, offload in runs if peak is not None else []:
        work = functools.partial(throughput, device, preset, args.nvme_dir, offload=offload, steps=steps, batch=4,
                                 peak=peak * 1e12)
        r = part(preset, work, into=result["throughput"])
        if r is None:
            continue
        print(f"  {preset} ({human_count(r['params'])}, states on {offload}): {r['tokens_per_s']:,.0f} tok/s, "
              f"{r['model_TFLOPS']:.1f} TFLOPS, MFU {r['MFU']:.1%}, GPU peak "
              f"{human_bytes(r['gpu_peak_allocated_bytes'])}", flush=True)
    result["shapes"] = {"deepspeed_zero3": deepspeed_note()}
    for row in SHAPES if peak is not None and io is not None and not args.quick else []:
        work = functools.partial(shape_row, row, args.nvme_dir, peak=peak * 1e12, disk=io, overlap=overlap)
        r = part(row, work, into=result["shapes"])
        if r is not None:
            predicted = r["predicted"]
            print(f"  {row} (K={r['accumulate']} x {r['batch']} x {r['seq']}): {r['tokens_per_s']:,.0f} tok/s, MFU "
                  f"{r['MFU']:.1%}, host RSS {human_bytes(r['peak_host_rss_bytes'])}, "
                  f"{human_bytes(r['bytes_read_per_step'])} read a step; predicted "
                  f"{predicted['tokens_per_s']:,.0f} tok/s, bound by {predicted['bound']}", flush=True)
    result["seconds"] = time.perf_counter() - t0
    result["ok"] = bool(not result.get("errors") and (tests or {}).get("ok", True)
                        and all(r["ok"] for r in rows or []) and (overlap or {}).get("ok", False))
    _write(args.out, result)
    print(f"gpu_check: {'all good' if result['ok'] else 'PROBLEMS FOUND (see the JSON)'} in "
          f"{result['seconds']:.0f} s; wrote {args.out}")
    return 0 if result["ok"] else 1


def run_part(result: dict, name: str, work: Callable[[], Any], out: str, *, into: dict | None = None) -> Any:
    """One part of the kit: its value goes into `into[name]` (default: `result[name]`), or its error
    into `result["errors"][name]`; either way `result` is written to `out` again. None if it failed."""
    try:
        value = work()
    except Exception as e:  # noqa: BLE001 - recorded, and the next part still runs
        result.setdefault("errors", {})[name] = {"error": f"{type(e).__name__}: {e}",
                                                 "traceback": traceback.format_exc()[-3000:]}
        print(f"  {name}: FAILED ({type(e).__name__}: {e})", flush=True)
        value = None
    else:
        (result if into is None else into)[name] = value
    _write(out, result)
    return value


def _write(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
