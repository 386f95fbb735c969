"""`outcore estimate --predict` against `outcore train` on this machine: the step predicted and
the step measured, for a ladder of shapes from the tiny preset to a LoRA on a Llama shape.

    python -m outcore.tools.kit.bench_predict --dir D [--rounds 2] [--cases tiny,gpt-125m,...]

Each case runs `outcore estimate --predict` and `outcore train` with the same model, batch,
sequence length and placement (the one the estimate recommends, which `train` also chooses, or the
budgets named), the train in a process of its own; rounds interleave the cases. The measured step
is the median of the steps' times in OUT/log.jsonl after the first (one row a step). One JSON line a
run; the last line holds the medians and each case's error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from outcore.tools.arg_types import positive_int

NVME_256M = ["--offload-params", "nvme", "--offload-optimizer", "nvme", "--device-budget", "256M",
             "--host-budget", "256M"]
CASES = {  # name: (model flags, shape flags, placement flags, steps)
    "tiny": (["--preset", "tiny"], ["--batch", "8", "--seq", "128"], [], 30),
    "gpt-125m": (["--preset", "gpt-125m"], ["--batch", "2", "--seq", "256"], [], 5),
    "bench-134m": (["--preset", "bench-134m"], ["--batch", "2", "--seq", "256"], [], 5),
    "bench-134m-256M": (["--preset", "bench-134m"], ["--batch", "2", "--seq", "256"], NVME_256M, 5),
    "llama-lora": (["--model", "{llama}", "--lora", "16"], ["--batch", "1", "--seq", "128"], [], 4),
    "llama-7b-lora": (["--model", "{llama7b}", "--lora", "16"], ["--batch", "1", "--seq", "128"],
                      ["--offload-params", "nvme", "--offload-optimizer", "nvme", "--device-budget", "3G",
                       "--host-budget", "1536M"], 3),
}


def _llama(directory: str, seven_b: bool = False) -> tuple[str, str]:
    """The Llama shape of bench_generate (16 x 1024, 253M parameters), or Llama-7B's (32 x 4096), and
    a JSONL of text rows its word-level tokenizer reads."""
    from outcore.tools.kit.bench_pretrained import make_model

    os.makedirs(directory, exist_ok=True)
    model = (make_model(directory, 32, 4096, intermediate=11008, kv_heads=32) if seven_b
             else make_model(directory, 16, 1024))
    data = os.path.join(directory, "rows.jsonl")
    if not os.path.exists(data):
        words = "the quick brown fox jumps over the lazy dog and the small cat sleeps near the warm fire".split()
        with open(data, "w") as f:
            for i in range(200):
                f.write(json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(300))}) + "\n")
    return model, data


def run_case(name: str, directory: str) -> dict:
    model_flags, shape, placement, steps = CASES[name]
    llama, data = "", ""
    if "{llama}" in model_flags:
        llama, data = _llama(os.path.join(directory, "llama"))
    elif "{llama7b}" in model_flags:
        llama, data = _llama(os.path.join(directory, "llama-7b"), seven_b=True)
    model_flags = [f.replace("{llama}", llama).replace("{llama7b}", llama) for f in model_flags]
    out = os.path.join(directory, f"run-{name}")
    predicted_json = os.path.join(directory, f"predicted-{name}.json")
    model_for_estimate = ["--model", llama, "--lora", "16"] if llama else ["--model", model_flags[1]]
    subprocess.run([sys.executable, "-m", "outcore.tools.cli", "estimate", *model_for_estimate, *shape,
                    *(["--stage", "3"] if placement else []), *placement, "--predict", "--nvme-dir", directory,
                    "--json", predicted_json], check=True, capture_output=True, text=True)
    predicted = json.load(open(predicted_json))["prediction"]
    train = [sys.executable, "-m", "outcore.tools.cli", "train", *model_flags, *shape, *placement,
             "--steps", str(steps), "--eval-every", "100000", "--no-save", "--log-every", "1", "--out", out,
             "--nvme-dir", os.path.join(directory, "swap")] + (["--data", data] if data else [])
    subprocess.run(train, check=True, capture_output=True, text=True)
    with open(os.path.join(out, "log.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    times = [r["tokens"] / r["tokens_per_second"] if i == 0 else
             (r["tokens"] - rows[i - 1]["tokens"]) / r["tokens_per_second"] for i, r in enumerate(rows)]
    os.remove(os.path.join(out, "log.jsonl"))
    measured = statistics.median(times[1:])
    return {"case": name, "predicted_s": predicted["step"], "measured_s": measured, "bound": predicted["bound"],
            "overhead_s": predicted["overhead"], "compute_s": predicted["compute"], "nvme_s": predicted["nvme"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m outcore.tools.kit.bench_predict")
    p.add_argument("--dir", required=True)
    p.add_argument("--rounds", type=positive_int, default=2)
    p.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    args = p.parse_args(argv)
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        p.error(f"--cases {args.cases}: choose from {', '.join(CASES)}")
    os.makedirs(args.dir, exist_ok=True)
    results: dict[str, list[dict]] = {c: [] for c in cases}
    for _ in range(args.rounds):
        for case in cases:
            line = run_case(case, args.dir)
            results[case].append(line)
            print(json.dumps(line), flush=True)
    summary = {}
    for case, lines in results.items():
        predicted = statistics.median(r["predicted_s"] for r in lines)
        measured = statistics.median(r["measured_s"] for r in lines)
        summary[case] = {"predicted_s": predicted, "measured_s": measured, "error": predicted / measured - 1}
    print(json.dumps({"medians": summary}))


if __name__ == "__main__":
    main()
