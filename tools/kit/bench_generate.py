"""Generation through the engine against the model whole in memory: what GRPO's and RLOO's sampling
costs under outcore ([Note: forward cycles] in runtime/forward_cycle.py).

    python -m outcore.tools.kit.bench_generate --dir D [--layers 16] [--hidden 1024] [--budget 256M]
                                           [--batch 4] [--prompt 16] [--new 32] [--rounds 3]
                                           [--kinds plain,resident,half,small] [--dtype fp32|bf16]

The Llama-shaped model of `bench_pretrained` (random bf16 weights, written once in D/model) is loaded
`plain` (transformers, whole in RAM) and through an engine with parameters on NVMe, both in
`--dtype` (fp32 by default) with peft's LoRA on every linear layer, as a GRPO policy is. The engine
runs at three budgets, device and host each: `resident`, twice the model's stored bytes (all of it
kept); `half`, half of them; `small`, `--budget`. Each kind runs in a process of its own (its peak
RSS its own), interleaved for `--rounds` rounds. Each greedy `generate` makes exactly `--new`
tokens for `--batch` prompts, after a first call of the same size (the load, the first call and
the timed one are apart). One JSON line a run; the last line holds the medians, and for each engine
kind its time a token against plain's and against the floor: the bytes it read a token over the
rate its frozen base is read at (in place from the weights files, measured once here), and its
share of the bytes a pass streaming every unit would read (`model_bytes`: the weights files and
the adapters).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from outcore.tools.arg_types import parse_size, positive_int
from outcore.tools.kit.bench_pretrained import make_model
from outcore.tools.report import peak_rss

KINDS = ("plain", "resident", "half", "small")


def run(kind: str, model_dir: str, scratch: str, budget: int, batch: int, prompt: int, new: int,
        dtype: str = "fp32") -> dict:
    import peft
    import transformers

    import outcore

    torch.manual_seed(0)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    x = torch.randint(3, 32000, (batch, prompt))
    t0 = time.perf_counter()
    engine = None
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    model: Any
    if kind == "plain":
        model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype),
                                    lora)
    else:
        with outcore.deferred_init():
            base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
            model = peft.get_peft_model(base, lora)
        stored = torch_dtype.itemsize * sum(p.numel() for p in model.parameters())
        each = {"resident": 2 * stored, "half": stored // 2, "small": budget}[kind]
        config = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=scratch,
                                dtype=dtype, device_budget=each, host_budget=each)
        engine = outcore.Engine(model, config, outcore.AdamW(lr=1e-4), weights=model_dir)
        model = engine.module
    load = time.perf_counter() - t0
    model.eval()

    def generate() -> torch.Tensor:
        with torch.no_grad():
            return model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False, pad_token_id=0)

    t0 = time.perf_counter()
    generate()  # the first call: the engine's cycle records the order and plans what it keeps
    first = time.perf_counter() - t0
    read0 = engine.stats()["bytes_read"] if engine else 0
    t0 = time.perf_counter()
    out = generate()
    seconds = time.perf_counter() - t0
    read = (engine.stats()["bytes_read"] - read0) if engine else 0
    row = {"kind": kind, "load_s": load, "first_s": first, "generate_s": seconds, "s_per_token": seconds / new,
           "tokens_per_s": batch * new / seconds, "bytes_read_per_token": read / new, "peak_rss": peak_rss(),
           "generated": out[:, prompt:].tolist()}
    if engine is not None:
        row["stored_bytes"] = sum(u.stored_nbytes for u in engine.units)
        row["model_bytes"] = model_bytes(model_dir, engine)
        row["budget_each"] = engine.stats()["device"]["budget"]
        engine.close()
    return row


def model_bytes(model_dir: str, engine: Any) -> int:
    """The bytes a pass reads when it streams every unit: the frozen base's weights files, read in
    place (bf16 here), and the adapters' units from the swap file."""
    weights = [os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors")]
    files = sum(os.path.getsize(f) for f in weights)
    return files + sum(u.stored_nbytes for u in engine.units if not u.frozen)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m outcore.tools.kit.bench_generate")
    p.add_argument("--dir", required=True)
    p.add_argument("--layers", type=positive_int, default=16)
    p.add_argument("--hidden", type=positive_int, default=1024, help="a multiple of 256")
    p.add_argument("--budget", type=parse_size, default=256 << 20, help="DEVICE and HOST budget each of `small`")
    p.add_argument("--batch", type=positive_int, default=4, help="prompts generated for at once")
    p.add_argument("--prompt", type=positive_int, default=16, help="tokens a prompt")
    p.add_argument("--new", type=positive_int, default=32, help="tokens generated a prompt")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="compute dtype of both (bf16: the base read in place as its files hold it, not widened)")
    p.add_argument("--_run", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.hidden % 256:
        p.error(f"--hidden {args.hidden}: give a multiple of 256 (attention heads of 128, two per key/value head)")
    kinds = args.kinds.split(",")
    if unknown := [k for k in kinds if k not in KINDS]:
        p.error(f"--kinds: {', '.join(unknown)} unknown; choose from {', '.join(KINDS)}")
    os.makedirs(args.dir, exist_ok=True)
    model_dir = os.path.join(args.dir, "model")
    if args._run:
        print(json.dumps(run(args._run, model_dir, os.path.join(args.dir, "swap"), args.budget, args.batch,
                             args.prompt, args.new, args.dtype)))
        return
    make_model(args.dir, args.layers, args.hidden)
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            cmd = [sys.executable, "-m", "outcore.tools.kit.bench_generate", "--dir", args.dir, "--budget",
                   str(args.budget), "--batch", str(args.batch), "--prompt", str(args.prompt), "--new", str(args.new),
                   "--dtype", args.dtype, "--_run", kind]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(f"{kind}: {res.stderr.strip().splitlines()[-1:]}")
            line = json.loads(res.stdout.strip().splitlines()[-1])
            results[kind].append(line)
            print(json.dumps({k: v for k, v in line.items() if k != "generated"}), flush=True)
    print(json.dumps(summary(results, measure_read_rate(model_dir))))


def measure_read_rate(model_dir: str) -> float:
    """Bytes/s the frozen base is read at: in place from its weights files, as the engine reads it."""
    from outcore.tools.machine_rates import measure_in_place_read

    return measure_in_place_read(model_dir)


def summary(results: dict[str, list[dict]], read_rate: float) -> dict:
    """Medians per kind; for the engine's kinds, the time a token over plain's and over the floor
    (the bytes read a token at `read_rate`), and whether greedy tokens equal plain's."""
    fields = ("s_per_token", "tokens_per_s", "bytes_read_per_token", "peak_rss", "load_s", "first_s")
    out: dict[str, Any] = {"read_rate_Bps": read_rate, "medians": {
        k: {f: statistics.median(r[f] for r in rs) for f in fields} for k, rs in results.items()}}
    plain = out["medians"].get("plain")
    for kind, m in out["medians"].items():
        if kind == "plain":
            continue
        m["model_bytes"] = results[kind][0]["model_bytes"]
        m["read_share"] = m["bytes_read_per_token"] / m["model_bytes"]
        m["floor_s_per_token"] = m["bytes_read_per_token"] / read_rate
        if plain is not None:
            m["over_plain"] = m["s_per_token"] / plain["s_per_token"]
            m["over_larger_of_plain_and_floor"] = m["s_per_token"] / max(plain["s_per_token"], m["floor_s_per_token"])
            m["same_tokens"] = all(r["generated"] == results["plain"][0]["generated"] for r in results[kind])
        if m["floor_s_per_token"] > 0:
            m["over_floor"] = m["s_per_token"] / m["floor_s_per_token"]
    return out


if __name__ == "__main__":
    main()
