"""Soak: many tiny training steps with NVMe offload, and whether memory or disk grows with them.

    python -m outcore.tools.kit.soak --steps 10000 [--preset tiny] [--seq 32] [--batch 2]
                                 [--offload nvme] [--host-budget 8M] [--samples 200]
                                 [--nvme-dir DIR] [--json PATH]

The engine trains `--steps` steps (parameters and optimizer states on NVMe by default, a small host
budget so that every step reads and writes the swap file). RSS and the swap file's size are sampled
evenly; after the first 10% of the steps (allocator and caches warming up) a least-squares line is
fitted to each, and its rise over the rest of the run is reported as a share of the mean. A leak
that grows with the number of steps shows as a steady rise; flat is within a few percent.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import psutil
import torch

from outcore import runtime
from outcore.offload.owned_dir import OwnedDir
from outcore.runtime.materialize import deferred_init
from outcore.runtime.sizes import human_bytes
from outcore.tools.arg_types import parse_size, positive_int
from outcore.tools.gpt import PRESETS, GPTConfig
from outcore.tools.model_source import resolve_model
from outcore.tools.report import check_json_argument, peak_rss, write_json

WARM_UP = 0.1  # share of the steps left out of the fit


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return slope, my - slope * mx


def trend(steps: list[int], values: list[int]) -> dict:
    """The fitted line over the samples after warm-up: per-step slope, and its rise over that span
    as a share of the mean value."""
    first = steps[-1] * WARM_UP
    kept = [(s, v) for s, v in zip(steps, values, strict=True) if s >= first]
    xs, ys = [float(s) for s, _ in kept], [float(v) for _, v in kept]
    slope, _ = fit_line(xs, ys)
    mean = sum(ys) / len(ys)
    rise = slope * (xs[-1] - xs[0])
    return {"slope_per_step": slope, "rise": rise, "rise_share": rise / mean if mean else 0.0, "mean": mean,
            "first": ys[0], "last": ys[-1], "min": min(ys), "max": max(ys), "samples": len(ys)}


def soak(*, steps: int, preset: str, seq: int, batch: int, offload: str, host_budget: int, samples: int,
         nvme_dir: str | None, report=print) -> dict:
    source = resolve_model(preset, seq=seq)
    assert source.gpt is not None
    with contextlib.ExitStack() as cleanup:
        if offload == "nvme" and nvme_dir is None:  # removed however the run ends, the engine's start included
            scratch = OwnedDir(".outcore-soak-", os.getcwd())
            cleanup.callback(scratch.remove)
            nvme_dir = scratch.path
        config = runtime.Config(stage=3, offload_params=offload, offload_optimizer=offload,
                                nvme_dir=nvme_dir if offload == "nvme" else None, host_budget=host_budget,
                                dtype="fp32")
        with deferred_init():
            model = source.build()
        engine = runtime.Engine(model, config, runtime.AdamW(lr=1e-4), init_fn=source.init_fn)
        cleanup.callback(engine.close)
        return _run(engine, source.gpt, steps=steps, seq=seq, batch=batch, samples=samples, report=report,
                    facts={"preset": preset, "offload": offload, "host_budget": host_budget})


def _run(engine: runtime.Engine, gpt: GPTConfig, *, steps: int, seq: int, batch: int, samples: int, report,
         facts: dict) -> dict:
    proc = psutil.Process()
    every = max(1, steps // samples)
    at: list[int] = []
    rss: list[int] = []
    swap: list[int] = []
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    before = engine.stats()
    for step in range(1, steps + 1):
        x = torch.randint(0, gpt.vocab, (batch, seq), generator=gen)
        engine.backward(engine(x, x))
        engine.step()
        if step % every == 0 or step == steps:
            engine.synchronize()
            stats = engine.stats()
            at.append(step)
            rss.append(proc.memory_info().rss)
            swap.append(stats["nvme"]["file_bytes"])
            if len(at) % max(1, samples // 10) == 0:
                report(f"step {step}/{steps}: RSS {human_bytes(rss[-1])}, swap file {human_bytes(swap[-1])}, "
                       f"{(time.perf_counter() - t0) / step * 1e3:.1f} ms/step, "
                       f"writes pending {stats['writes_pending']}")
    seconds = time.perf_counter() - t0
    io = {k: (engine.stats()[k] - before[k]) / steps for k in ("bytes_read", "bytes_written")}
    result = {"steps": steps, **facts, "seq": seq, "batch": batch, "seconds": seconds,
              "samples": {"step": at, "rss": rss, "swap": swap},
              "rss": trend(at, rss), "swap": trend(at, swap), "peak_rss_bytes": peak_rss(),
              **{f"{k}_per_step": v for k, v in io.items()}}
    r, s = result["rss"], result["swap"]
    report(f"{steps} steps in {seconds:.0f} s ({seconds / steps * 1e3:.1f} ms/step), each reading "
           f"{human_bytes(io['bytes_read'])} and writing {human_bytes(io['bytes_written'])} of NVMe; after the first "
           f"{WARM_UP:.0%}:")
    report(f"  RSS {human_bytes(r['first'])} -> {human_bytes(r['last'])} (min {human_bytes(r['min'])}, max "
           f"{human_bytes(r['max'])}); fitted slope {r['slope_per_step']:+.1f} B/step, rise {r['rise_share']:+.2%}")
    report(f"  swap file {human_bytes(s['first'])} -> {human_bytes(s['last'])}; fitted slope "
           f"{s['slope_per_step']:+.1f} B/step, rise {s['rise_share']:+.2%}")
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m outcore.tools.kit.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=positive_int, default=10000)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--seq", type=positive_int, default=32)
    p.add_argument("--batch", type=positive_int, default=2)
    p.add_argument("--offload", choices=("nvme", "cpu", "none"), default="nvme")
    p.add_argument("--host-budget", type=parse_size, default=parse_size("8M"))
    p.add_argument("--samples", type=positive_int, default=200)
    p.add_argument("--nvme-dir")
    p.add_argument("--json")
    a = p.parse_args(argv)
    check_json_argument(p, a.json)  # before a run that may take hours
    try:
        res = soak(steps=a.steps, preset=a.preset, seq=a.seq, batch=a.batch, offload=a.offload,
                   host_budget=a.host_budget, samples=a.samples, nvme_dir=a.nvme_dir)
    except ValueError as e:  # a setting the engine refuses: one line and exit 2, as argparse's own
        p.error(str(e))
    write_json(a.json, res)


if __name__ == "__main__":
    main()
