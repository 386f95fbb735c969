"""Peers in one run: plain PyTorch, outcore and DeepSpeed ZeRO-3 training the same GPT.

    python -m outcore.tools.kit.bench_peers [--preset bench-134m] [--batch 2] [--steps 8] [--rounds 3]
                                        [--dir .] [--kinds plain,outcore,deepspeed] [--json PATH]

outcore and DeepSpeed both keep parameters and optimizer states on NVMe (`--dir`), fp32, no
clipping, each with its default budgets; plain PyTorch keeps everything in memory. The kind
`deepspeed-cpu` (asked for by name) offloads both to CPU memory instead: DeepSpeed's own cost with
no disk in its step, which tells how much of its NVMe step is I/O. Each run is its
own process, the kinds are interleaved over `--rounds`, and the table gives medians: seconds per
step (after a warm-up step), the ratio to plain, peak RSS, and the bytes the process read and
wrote on the disk per step (the kernel's count, the same for every kind); then each kind's ratio
to the first, round by round.

DeepSpeed is not a dependency of outcore. Where `import deepspeed` works, it runs; else its row
says so. It needs libaio's headers to build its NVMe op (`apt install libaio-dev`, then
`pip install deepspeed`); it compiles its ops on first use, which the warm-up step absorbs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

from outcore.runtime.sizes import human_bytes
from outcore.tools.report import check_json_argument, peak_rss, table, write_json

DEEPSPEED_OFFLOAD = {"deepspeed": "nvme", "deepspeed-cpu": "cpu"}  # kind -> where both states go
KINDS = ("plain", "outcore", *DEEPSPEED_OFFLOAD)
DEFAULT_KINDS = KINDS[:3]


def deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to import means no DeepSpeed row
        return False
    return True


def deepspeed_config(batch: int, offload: str, nvme_path: str) -> dict:
    """ZeRO-3, fp32, no clipping, parameters and optimizer states offloaded to `offload` ("nvme" or "cpu")."""
    where = {"device": offload, **({"nvme_path": nvme_path} if offload == "nvme" else {})}
    return {
        "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "offload_param": dict(where), "offload_optimizer": dict(where)},
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1},
    }


def run_deepspeed(preset: str, batch: int, steps: int, nvme_root: str, offload: str = "nvme") -> dict:
    """DeepSpeed ZeRO-3 with parameters and optimizer states offloaded to `offload` (NVMe through its aio op)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    import deepspeed
    import torch

    from outcore.tools.gpt import GPT, PRESETS

    cfg = PRESETS[preset]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g) for _ in range(steps + 1)]
    with tempfile.TemporaryDirectory(dir=nvme_root) as d:
        ds_config = deepspeed_config(batch, offload, d)
        deepspeed.init_distributed(dist_backend="gloo")
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = GPT(cfg)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
        starts = []
        for tokens in data:
            starts.append(time.perf_counter())
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
        times = [b - a for a, b in zip(starts, [*starts[1:], time.perf_counter()], strict=True)]
        engine.destroy()
    return {"step_s": statistics.median(times[1:]), "all_steps_s": times, "peak_rss": peak_rss()}


def run_kind(kind: str, preset: str, batch: int, steps: int, nvme_root: str) -> dict:
    """One kind in this process, with the disk bytes it moved per step."""
    from outcore.tools.kit.bench_engine import run_step

    io0 = psutil.Process().io_counters()
    if kind in DEEPSPEED_OFFLOAD:
        out = run_deepspeed(preset, batch, steps, nvme_root, DEEPSPEED_OFFLOAD[kind])
    else:
        out = run_step("plain" if kind == "plain" else "nvme-noclip", preset, batch, steps, nvme_root, None)
    io1 = psutil.Process().io_counters()
    n = steps + 1
    return {**out, "kind": kind, "disk_read_per_step": (io1.read_bytes - io0.read_bytes) / n,
            "disk_written_per_step": (io1.write_bytes - io0.write_bytes) / n}


def _child(spec: dict) -> dict:
    res = subprocess.run([sys.executable, "-m", "outcore.tools.kit.bench_peers", "_run", json.dumps(spec)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        return {"kind": spec["kind"], "error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from outcore.tools.gpt import PRESETS

    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["_run"]:
        print(json.dumps(run_kind(**json.loads(argv[1]))))
        return 0
    p = argparse.ArgumentParser(prog="python -m outcore.tools.kit.bench_peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bench-134m", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=".", help="where both runtimes put their NVMe files")
    p.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help=f"from {', '.join(KINDS)}")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    check_json_argument(p, args.json)  # before rounds that take minutes
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if set(kinds) - set(KINDS):
        p.error(f"--kinds: choose from {', '.join(KINDS)}")
    deepspeed_kinds = [k for k in kinds if k in DEEPSPEED_OFFLOAD]
    if deepspeed_kinds and not deepspeed_available():
        print(f"deepspeed is not importable here: {', '.join(deepspeed_kinds)} left out (see this module's "
              "docstring to install it)")
        kinds = [k for k in kinds if k not in DEEPSPEED_OFFLOAD]
    os.makedirs(args.dir, exist_ok=True)
    results = []
    for r in range(args.rounds):
        for kind in kinds:
            res = _child({"kind": kind, "preset": args.preset, "batch": args.batch, "steps": args.steps,
                          "nvme_root": os.path.abspath(args.dir)})
            results.append({**res, "round": r})
            print(f"round {r + 1}/{args.rounds} {kind}: " + (f"{res['step_s']:.2f} s/step" if "step_s" in res
                                                            else f"failed: {res['error']}"), flush=True)
    plain = [x["step_s"] for x in results if x["kind"] == kinds[0] and "step_s" in x]
    base = statistics.median(plain) if plain else float("nan")
    rows = []
    for kind in kinds:
        ok = [x for x in results if x["kind"] == kind and "step_s" in x]
        if not ok:
            rows.append([kind, "failed", "", "", "", ""])
            continue
        step = statistics.median(x["step_s"] for x in ok)
        rows.append([kind, f"{step:.2f}", f"{step / base:.2f}x", human_bytes(max(x["peak_rss"] for x in ok)),
                     human_bytes(statistics.median(x["disk_read_per_step"] for x in ok)),
                     human_bytes(statistics.median(x["disk_written_per_step"] for x in ok))])
    print(f"{args.preset}, batch {args.batch}, fp32, no clipping, {args.steps} steps after a warm-up, medians of "
          f"{args.rounds} interleaved rounds; ratios to {kinds[0]}:")
    table(["kind", "s/step", "ratio", "peak RSS", "disk read/step", "disk written/step"], rows)
    # The machine is shared: how far the ratio swings from round to round says what its median is worth.
    by_round = {(x["kind"], x["round"]): x["step_s"] for x in results if "step_s" in x}
    for kind in kinds[1:]:
        ratios = [f"{by_round[kind, r] / by_round[kinds[0], r]:.2f}" for r in range(args.rounds)
                  if (kind, r) in by_round and (kinds[0], r) in by_round]
        if ratios:
            print(f"  {kind} / {kinds[0]}, round by round: {' '.join(ratios)}")
    write_json(args.json, {"results": results, "kinds": kinds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
