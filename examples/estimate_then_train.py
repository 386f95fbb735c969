"""Ask `outcore estimate` whether a run fits this machine and with which flags, then train with them.

    python examples/estimate_then_train.py                                 # a tiny local model, offline
    python examples/estimate_then_train.py --model /models/llama-8b --lora 16 --quantize nf4

The same as running `outcore estimate --model DIR --lora 16 --batch 2 --seq 64 --json e.json`, reading
its verdict, and pasting its flags after `outcore train`.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys

from tiny_model import notes, tiny_llama, write_jsonl


def outcore(*args: str) -> None:
    print("$ outcore " + " ".join(shlex.quote(a) for a in args), flush=True)
    subprocess.run([sys.executable, "-m", "outcore.tools.cli", *args], check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Hugging Face model directory (default: a tiny one built here)")
    p.add_argument("--lora", default="8")
    p.add_argument("--quantize", choices=("nf4", "fp4", "int8"))
    p.add_argument("--out", default="estimated-run")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model = a.model or tiny_llama(os.path.join(a.out, "tiny-llama"))
    quantize = ["--quantize", a.quantize] if a.quantize else []
    estimate = os.path.join(a.out, "estimate.json")
    outcore("estimate", "--model", model, "--lora", a.lora, *quantize, "--batch", "2", "--seq", "32", "--json",
            estimate)
    verdict = json.load(open(estimate))["verdict"]
    if not verdict["fits"]:
        sys.exit("does not fit this machine: " + "; ".join(verdict["short"]))
    data = write_jsonl(os.path.join(a.out, "notes.jsonl"), notes(24))
    outcore("train", "--model", model, "--lora", a.lora, *quantize, "--data", data, "--steps", "4", "--batch", "2",
            "--seq", "32", "--out", os.path.join(a.out, "run"), *verdict["flags"].split())


if __name__ == "__main__":
    main()
