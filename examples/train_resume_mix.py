"""`outcore train` on two datasets mixed by weight, stopped, then resumed by its run directory alone.

    python examples/train_resume_mix.py                                    # a tiny local model, offline

The same as these commands (what this script runs):

    outcore train --model DIR --lora 8 --data chats.jsonl:3 --data notes.jsonl:1 --steps 4 --out mix-run
    outcore train --out mix-run --resume --steps 8       # goes on with the arguments in mix-run/run.json
"""

import argparse
import os
import subprocess
import sys

from tiny_model import chats, notes, tiny_llama, write_jsonl


def outcore(*args: str) -> None:
    print("$ outcore " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "outcore.tools.cli", *args], check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Hugging Face model directory (default: a tiny one built here)")
    p.add_argument("--out", default="mix-run")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model = a.model or tiny_llama(os.path.join(a.out, "tiny-llama"))
    chat_file = write_jsonl(os.path.join(a.out, "chats.jsonl"), chats(24))
    note_file = write_jsonl(os.path.join(a.out, "notes.jsonl"), notes(24))
    run = os.path.join(a.out, "run")
    outcore("train", "--model", model, "--lora", "8", "--data", f"{chat_file}:3", "--data", f"{note_file}:1",
            "--steps", "4", "--batch", "2", "--seq", "32", "--out", run)
    outcore("train", "--out", run, "--resume", "--steps", "8")
    print(f"trained 8 steps in two runs; adapters in {run}/adapters")


if __name__ == "__main__":
    main()
