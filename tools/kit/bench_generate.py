"""Generation through the engine against the model whole in memory: what GRPO's and RLOO's sampling
costs under outcore, where every new token runs the whole model and reads again what the device
tier does not hold.

    python -m outcore.tools.kit.bench_generate --dir D [--layers 16] [--hidden 1024] [--budget 256M]
                                           [--batch 4] [--prompt 16] [--new 32] [--rounds 3]

The Llama-shaped model of `bench_pretrained` (random bf16 weights, written once in D/model) is loaded
`plain` (transformers, whole in RAM) and through an engine with parameters on NVMe at `--budget`
device and host (`engine`), both in fp32 with peft's LoRA on every linear layer, as a GRPO policy
is; each kind in a process of its own (its peak RSS its own), interleaved for `--rounds` rounds. Each greedy
`generate` makes exactly `--new` tokens for `--batch` prompts; the load is timed apart. One JSON line
a run; the last line holds the medians.
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

KINDS = ("plain", "engine")


def run(kind: str, model_dir: str, scratch: str, budget: int, batch: int, prompt: int, new: int) -> dict:
    import peft
    import transformers

    import outcore

    torch.manual_seed(0)
    x = torch.randint(3, 32000, (batch, prompt))
    t0 = time.perf_counter()
    engine = None
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    model: Any
    if kind == "plain":
        model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                    lora)
    else:
        with outcore.deferred_init():
            base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
            model = peft.get_peft_model(base, lora)
        config = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=scratch,
                                dtype="fp32", device_budget=budget, host_budget=budget)
        engine = outcore.Engine(model, config, outcore.AdamW(lr=1e-4), weights=model_dir)
        model = engine.module
    load = time.perf_counter() - t0
    model.eval()
    read0 = engine.stats()["bytes_read"] if engine else 0
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - t0
    read = (engine.stats()["bytes_read"] - read0) if engine else 0
    if engine is not None:
        engine.close()
    return {"kind": kind, "load_s": load, "generate_s": seconds, "s_per_token": seconds / new,
            "tokens_per_s": batch * new / seconds, "bytes_read_per_token": read / new, "peak_rss": peak_rss(),
            "generated": out[:, prompt:].tolist()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m outcore.tools.kit.bench_generate")
    p.add_argument("--dir", required=True)
    p.add_argument("--layers", type=positive_int, default=16)
    p.add_argument("--hidden", type=positive_int, default=1024, help="a multiple of 256")
    p.add_argument("--budget", type=parse_size, default=256 << 20, help="DEVICE and HOST budget each")
    p.add_argument("--batch", type=positive_int, default=4, help="prompts generated for at once")
    p.add_argument("--prompt", type=positive_int, default=16, help="tokens a prompt")
    p.add_argument("--new", type=positive_int, default=32, help="tokens generated a prompt")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--_run", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.hidden % 256:
        p.error(f"--hidden {args.hidden}: give a multiple of 256 (attention heads of 128, two per key/value head)")
    os.makedirs(args.dir, exist_ok=True)
    model_dir = os.path.join(args.dir, "model")
    if args._run:
        print(json.dumps(run(args._run, model_dir, os.path.join(args.dir, "swap"), args.budget, args.batch,
                             args.prompt, args.new)))
        return
    make_model(args.dir, args.layers, args.hidden)
    results: dict[str, list[dict]] = {k: [] for k in KINDS}
    for _ in range(args.rounds):
        for kind in KINDS:
            cmd = [sys.executable, "-m", "outcore.tools.kit.bench_generate", "--dir", args.dir, "--budget",
                   str(args.budget), "--batch", str(args.batch), "--prompt", str(args.prompt), "--new", str(args.new),
                   "--_run", kind]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(f"{kind}: {res.stderr.strip().splitlines()[-1:]}")
            line = json.loads(res.stdout.strip().splitlines()[-1])
            results[kind].append(line)
            print(json.dumps(line), flush=True)
    medians = {k: {f: statistics.median(r[f] for r in rs) for f in ("s_per_token", "tokens_per_s",
                                                                        "bytes_read_per_token", "peak_rss", "load_s")}
               for k, rs in results.items()}
    ratio = medians["engine"]["s_per_token"] / medians["plain"]["s_per_token"]
    print(json.dumps({"medians": medians, "engine_over_plain": ratio}))


if __name__ == "__main__":
    main()
