"""Engine benchmarks: optimizer throughput and training-step time against plain PyTorch.

    python -m outcore.tools.kit.bench_engine optimizer [--params 100M] [--repeats 5]
    python -m outcore.tools.kit.bench_engine store [--dir D] [--repeats 3]
    python -m outcore.tools.kit.bench_engine step [--preset bench-134m] [--batch 2] [--steps 8] [--rounds 1]
                                      [--dtype fp32] [--kinds plain,nvme-noclip,nvme-clip] [--accumulate K]
                                      [--budget 256M|derived] [--host-budget SIZE] [--checkpoint] [--no-fio]

Step kinds: `plain` (PyTorch with fused AdamW, fp32 only), `ram` (the engine, nothing offloaded,
no clipping), `nvme-noclip` and `nvme-clip` (parameters and optimizer states on NVMe, clipping
at 1.0, which the reference GPT's gradients reach every step), `nvme-clip-unreached` (clipping at
1000, which they never reach: a fine-tuning run's usual step, where clipping is set and rarely
clips), and `nvme-vertical` (as nvme-noclip, each step one `train_batch` of `--accumulate`
micro-batches).
An engine kind ending in `+bf16` keeps its optimizer states in bf16 (`Config.state_dtype`).
Ratios are against the first kind listed.

Every configuration runs in its own process, so that its peak RSS is its own; configurations are
interleaved (plain, ours, plain, ours, ...) and medians reported, because this machine is shared.
After each round, where fio is installed, fio reads and writes the same folder at once for a few
seconds: the disk's speed of the moment, next to which each NVMe kind reports how long per step
its own I/O kept the disk busy and at what speed. Each kind also reports its CPU-seconds per step
(the median step, all threads) and the floor they put under the step: CPU-seconds over the cores,
as a ratio to the first kind's step, which no schedule can beat.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from outcore.runtime.sizes import human_bytes, parse_size
from outcore.tools.fio import fio_available, fio_mixed_throughput
from outcore.tools.report import check_json_argument, peak_rss, write_json

DISK_BLOCK, DISK_DEPTH = 8 << 20, 4  # the NVMe runs' IOConfig (8 MiB blocks, 4 threads), and fio's

# -- what one process measures ---------------------------------------------------------------------

def run_optimizer(kind: str, params: int, repeats: int) -> dict:
    """Seconds of one AdamW step over `params` fp32 parameters with states in RAM."""
    from outcore import runtime

    width = 2048
    layers = max(1, params // (width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    n = sum(p.numel() for p in model.parameters())
    times = []
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, width, generator=g)
    loss_of = lambda out: out.square().mean() * 1e6  # noqa: E731 - gradients far from denormal range
    if kind == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        for _ in range(repeats + 1):  # the same real gradients as ours: same model, input and loss
            opt.zero_grad()
            loss_of(model(x)).backward()
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    else:
        wrapped = torch.nn.Module()
        wrapped.blocks = torch.nn.ModuleList(model)
        wrapped.forward = lambda x: model(x)  # noqa: E731
        with tempfile.TemporaryDirectory() as d:
            cfg = runtime.Config(stage=3, nvme_dir=d, grad_clip=1e12, prefetch_depth=2)
            engine = runtime.Engine(wrapped, cfg, runtime.AdamW(lr=1e-4))
            for _ in range(repeats + 1):
                engine.backward(loss_of(engine(x)))
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            engine.close()
    step = statistics.median(times[1:])
    return {"kind": kind, "params": n, "step_s": step, "params_per_s": n / step, "peak_rss": peak_rss()}


def run_store(directory: str, keys: int = 32, rounds: int = 40) -> dict:
    """The store alone, no model: `keys` keys of 1 MiB through 8 MiB budgets, each round fetching
    8 of them onto DEVICE (the next 4 prefetched into HOST), changing them in place and releasing
    them dirty, so that every fetch evicts, writes back and reads; then a flush. Seconds."""
    import tempfile

    from outcore.offload import IOConfig, TieredStore

    with tempfile.TemporaryDirectory(dir=directory) as swap_dir:
        return _churn(TieredStore(swap_dir, "cpu", device_budget=8 << 20, host_budget=8 << 20,
                                  io=IOConfig(threads=4, block_size=1 << 20)), keys, rounds)


def _churn(store, keys: int, rounds: int) -> dict:
    from outcore.offload import Tier

    try:
        for i in range(keys):
            store.put(f"k{i}", torch.full((1 << 18,), float(i)), Tier.NVME)
        store.flush()
        t0 = time.perf_counter()
        for r in range(rounds):
            names = [f"k{(r * 7 + j) % keys}" for j in range(8)]
            store.prefetch(names[4:], Tier.HOST)
            for name in names:
                store.fetch_now(name, Tier.DEVICE).add_(1)
                store.release(name, dirty=True)
        store.flush()
        seconds, stats = time.perf_counter() - t0, store.stats()
        return {"seconds": seconds, "fetches": rounds * 8, "writebacks": stats["writebacks"],
                "bytes_read": stats["bytes_read"]}
    finally:
        store.close()


def run_step(kind: str, preset: str, batch: int, steps: int, nvme_root: str, budget: int | None,
             dtype: str = "fp32", checksum: bool = True, host_budget: int | None = None,
             checkpoint: bool = False, accumulate: int = 1) -> dict:
    """Median seconds of a training step of the preset GPT, plain or through the engine. A step is
    `accumulate` micro-batches: backward after each and one update (`nvme-vertical`: one
    `train_batch` of them, parameters and optimizer states on NVMe, no clipping)."""
    from outcore import runtime
    from outcore.tools.gpt import GPT, PRESETS

    cfg = PRESETS[preset]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [[torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g) for _ in range(accumulate)]
            for _ in range(steps + 1)]
    times, io = [], None
    usage = []  # (user s, system s, minor faults) of the whole process after each step
    if kind == "plain":
        model = GPT(cfg, checkpoint_activations=checkpoint)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        for micro_batches in data:
            t0 = time.perf_counter()
            opt.zero_grad()
            for tokens in micro_batches:
                (model(tokens[:, :-1], tokens[:, 1:]) / accumulate).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            usage.append(_usage())
    else:
        base, _, states = kind.partition("+")
        clip = {"nvme-clip": 1.0, "nvme-clip-unreached": 1000.0}.get(base)
        vertical = base == "nvme-vertical"
        offload = "none" if base == "ram" else "nvme"  # nvme-*
        with runtime.deferred_init():
            model = GPT(cfg, checkpoint_activations=checkpoint)
        from outcore.tools.gpt import init_fn

        with tempfile.TemporaryDirectory(dir=nvme_root) as d:
            # DEVICE and HOST budgets of `budget` bytes (HOST: `host_budget` if given): the store pages
            # the rest through NVMe.
            conf = runtime.Config(stage=3, offload_params=offload, offload_optimizer=offload, nvme_dir=d,
                                  grad_clip=clip, prefetch_depth=2, dtype=dtype, state_dtype=states or "fp32",
                                  grad_accumulation=1 if vertical else accumulate,
                                  device_budget=budget if offload == "nvme" else None,
                                  host_budget=(host_budget or budget) if offload == "nvme" else None,  # None: derived
                                  sub_group_size=1 << 21,
                                  io=runtime.IOConfig(block_size=DISK_BLOCK, threads=DISK_DEPTH, checksum=checksum))
            engine = runtime.Engine(model, conf, runtime.AdamW(lr=1e-4), init_fn=init_fn(cfg))
            before = None
            starts = []
            for i, micro_batches in enumerate(data):
                if i == 1:  # the warm-up step's updates landed: the counts below are steps 1.. only
                    engine.synchronize()
                    before, usage[0] = engine.stats(), _usage()
                starts.append(time.perf_counter())
                if vertical:
                    engine.train_batch([(t[:, :-1], t[:, 1:]) for t in micro_batches])
                for tokens in micro_batches if not vertical else []:
                    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
                    engine.step()
                if i == len(data) - 1:
                    engine.synchronize()  # the last step's updates, which the next forward would wait for
                usage.append(_usage())
            # `step()` returns before streamed updates land (the next forward waits for them), so a
            # step is timed from its start to the next one's, the last to the end of its updates.
            times = [b - a for a, b in zip(starts, [*starts[1:], time.perf_counter()], strict=True)]
            after = engine.stats()
            engine.close()
        n = len(data) - 1
        assert before is not None  # taken after the warm-up step
        io = {"read_bytes_per_step": (after["bytes_read"] - before["bytes_read"]) / n,
              "written_bytes_per_step": (after["bytes_written"] - before["bytes_written"]) / n,
              "io_busy_s_per_step": (after["io_busy_seconds"] - before["io_busy_seconds"]) / n,
              "unit_wait_s_per_step": (after["unit_wait_seconds"] - before["unit_wait_seconds"]) / n,
              "prefetch_hit_rate": after["prefetch_hit_rate"]}
    step = statistics.median(times[1:])  # the first step records the trace and warms up
    # Medians of each step's own counts after the warm-up step, like `step`: a mean would charge the
    # steady state with plain PyTorch's slower first steps.
    cpu = {f"{name}_per_step": statistics.median(b[i] - a[i] for a, b in itertools.pairwise(usage))
           for i, name in enumerate(("user_s", "sys_s", "minflt"))}
    out = {"kind": kind, "preset": preset, "dtype": dtype, "accumulate": accumulate, "step_s": step,
           "all_steps_s": times,
           "peak_rss": peak_rss(), **cpu}
    if io:
        out.update(io, wait_fraction=io["unit_wait_s_per_step"] / step)
    return out


def _usage() -> tuple[float, float, int]:
    # CPU seconds show what the wall clock hides on 2 cores: I/O threads and copies competing with compute.
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


# -- the driver ------------------------------------------------------------------------------------

def _disk_reference(folder: str, seconds: float = 5.0) -> dict | None:
    """What the disk gives right now to a steady half-read, half-write load (fio), for comparison with
    the bytes a step moves: the disk's speed here swings by 2x from one run to the next. None (said
    on stderr) when fio fails there, say on a filesystem without O_DIRECT: the steps still count."""
    path = os.path.join(folder, f"outcore-fio-{os.getpid()}.bin")
    try:
        rd, wr = fio_mixed_throughput(path, size=1 << 30, block_size=DISK_BLOCK, queue_depth=DISK_DEPTH,
                                      seconds=seconds)
    except (subprocess.CalledProcessError, ValueError, KeyError) as e:
        lines = (e.stderr or "").strip().splitlines() if isinstance(e, subprocess.CalledProcessError) else []
        detail = lines[-1] if lines else e
        print(f"fio failed in {folder} ({detail}); no disk reference for this round", file=sys.stderr)
        return None
    finally:
        if os.path.exists(path):
            os.remove(path)
    return {"kind": "fio-mixed", "read_Bps": rd, "write_Bps": wr}


def _budget(text: str) -> int | None:
    return None if text == "derived" else parse_size(text)


def _child(args: list[str]) -> dict:
    res = subprocess.run([sys.executable, "-m", "outcore.tools.kit.bench_engine", "_run", *args],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"benchmark process failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from outcore.tools.gpt import PRESETS

    p = argparse.ArgumentParser(prog="python -m outcore.tools.kit.bench_engine")
    sub = p.add_subparsers(dest="what", required=True)
    o = sub.add_parser("optimizer")
    o.add_argument("--params", type=parse_size, default=100_000_000)
    o.add_argument("--repeats", type=int, default=5)
    st = sub.add_parser("store")
    st.add_argument("--dir", default=".", help="where the swap file goes")
    st.add_argument("--repeats", type=int, default=3)
    s = sub.add_parser("step")
    s.add_argument("--preset", default="bench-134m", choices=sorted(PRESETS))
    s.add_argument("--batch", type=int, default=2)
    # Eight: plain PyTorch's steps keep falling through the first four or so (glibc's heap grows to
    # fit them), and a median over those would flatter the engine against it.
    s.add_argument("--steps", type=int, default=8)
    s.add_argument("--rounds", type=int, default=1)
    s.add_argument("--dir", default=".", help="where the NVMe swap files go")
    s.add_argument("--budget", type=_budget, default=256 << 20,
                   help="DEVICE and HOST budget each, or 'derived': the engine's own from the machine")
    s.add_argument("--host-budget", type=parse_size, help="HOST budget, if not --budget")
    s.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block (every kind)")
    s.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    s.add_argument("--kinds", default="plain,nvme-noclip,nvme-clip", help="what to run; ratios are to the first")
    s.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (nvme-vertical: one train_batch)")
    s.add_argument("--no-checksum", action="store_true", help="NVMe runs skip crc32 (IOConfig(checksum=False))")
    s.add_argument("--no-fio", action="store_true", help="skip the disk reference (fio) run after each round")
    for q in (o, s):
        q.add_argument("--json", metavar="PATH")
    r = sub.add_parser("_run")
    r.add_argument("spec")
    args = p.parse_args(argv)
    check_json_argument(p, getattr(args, "json", None))  # before rounds that take minutes

    if args.what == "_run":
        spec = json.loads(args.spec)
        fn = run_optimizer if spec.pop("case") == "optimizer" else run_step
        print(json.dumps(fn(**spec)))
        return 0
    results = []
    if args.what == "store":
        times = [run_store(args.dir)["seconds"] for _ in range(args.repeats)]
        print(f"the store alone, 320 fetches changed and written back through 8 MiB budgets: "
              f"{statistics.median(times):.3f} s median of {', '.join(f'{t:.3f}' for t in times)}")
        return 0
    if args.what == "optimizer":
        for _ in range(args.repeats):
            for kind in ("torch", "ours"):
                results.append(_child([json.dumps({"case": "optimizer", "kind": kind, "params": args.params,
                                                   "repeats": 3})]))
        med = {k: statistics.median(r["params_per_s"] for r in results if r["kind"] == k) for k in ("torch", "ours")}
        print(f"AdamW step over {results[0]['params']:,} fp32 params, states in RAM, median of {args.repeats}:")
        for k, v in med.items():
            print(f"  {k:6s} {v / 1e9:.2f} G params/s")
        print(f"  ours / torch fused: {med['ours'] / med['torch']:.2f}x")
    else:
        os.makedirs(args.dir, exist_ok=True)
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        engine_kinds = {"ram", "nvme-noclip", "nvme-clip", "nvme-clip-unreached", "nvme-vertical"}
        unknown = set(kinds) - {"plain", *engine_kinds, *(k + "+bf16" for k in engine_kinds)}
        if unknown or ("plain" in kinds and args.dtype != "fp32"):
            p.error(f"--kinds {args.kinds}: choose from plain (fp32 only), ram, nvme-noclip, nvme-clip, "
                    "nvme-clip-unreached, nvme-vertical")
        for _ in range(args.rounds):
            for kind in kinds:
                results.append(_child([json.dumps({"case": "step", "kind": kind, "preset": args.preset,
                                                   "batch": args.batch, "steps": args.steps,
                                                   "nvme_root": os.path.abspath(args.dir),
                                                   "budget": args.budget, "host_budget": args.host_budget,
                                                   "checkpoint": args.checkpoint, "dtype": args.dtype,
                                                   "checksum": not args.no_checksum,
                                                   "accumulate": args.accumulate})]))
            if not args.no_fio and fio_available() and any(k.startswith("nvme") for k in kinds):
                reference = _disk_reference(args.dir)
                if reference is not None:
                    results.append(reference)
        plain = statistics.median(r["step_s"] for r in results if r["kind"] == kinds[0])
        disk = [r for r in results if r["kind"] == "fio-mixed"]
        budgets = human_bytes(args.budget) if args.budget is not None else "derived"
        budgets += f" / {human_bytes(args.host_budget)}" if args.host_budget else ""
        ckpt = ", activation checkpointing" if args.checkpoint else ""
        accum = f", {args.accumulate} micro-batches per step" if args.accumulate > 1 else ""
        print(f"{args.preset}, batch {args.batch}{accum}, {args.dtype}{ckpt}, NVMe-run budgets {budgets}; "
              f"median step of {args.steps} after a warm-up step, ratios to {kinds[0]}:")
        for kind in kinds:
            rs = [r for r in results if r["kind"] == kind]
            step = statistics.median(r["step_s"] for r in rs)
            rss = human_bytes(max(r["peak_rss"] for r in rs))
            cpu = statistics.median(r["user_s_per_step"] + r["sys_s_per_step"] for r in rs)
            # No schedule beats CPU-seconds over cores: the ratio that bound alone gives against plain.
            floor = cpu / len(os.sched_getaffinity(0)) / plain
            line = (f"  {kind:12s} {step:6.2f} s/step  {step / plain:5.2f}x  peak RSS {rss}  CPU {cpu:.2f} s/step"
                    f" (sys {statistics.median(r['sys_s_per_step'] for r in rs):.2f}, floor {floor:.2f}x)")
            if "wait_fraction" in rs[0]:
                r0 = rs[0]
                line += (f"  I/O wait {r0['wait_fraction']:.0%}  read {human_bytes(r0['read_bytes_per_step'])}"
                         f"/step  written {human_bytes(r0['written_bytes_per_step'])}/step")
                busy = statistics.median(r["io_busy_s_per_step"] for r in rs)
                moved = statistics.median(r["read_bytes_per_step"] + r["written_bytes_per_step"] for r in rs)
                if moved:
                    line += f"  disk busy {busy:.2f} s/step at {moved / max(busy, 1e-9) / 1e9:.2f} GB/s"
            print(line)
        if disk:
            rd, wr = (statistics.median(r[k] for r in disk) / 1e9 for k in ("read_Bps", "write_Bps"))
            print(f"  disk (fio after each round, reading and writing at once, {DISK_BLOCK >> 20} MiB blocks, depth "
                  f"{DISK_DEPTH}): {rd:.2f} GB/s read + {wr:.2f} GB/s written.")
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
