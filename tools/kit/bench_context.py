"""Long context, one step at a time: plain transformers + peft against `outcore train`, at growing `--seq`.

    python -m outcore.tools.kit.bench_context [--seqs 2048,4096,8192] [--max-memory 6G] [--steps 1]
                                             [--rounds 1] [--kinds plain,outcore] [--dir .] [--json PATH]
                                             [-- EXTRA OUTCORE TRAIN FLAGS]

The model is a Llama shape with Llama 3's vocabulary (8 blocks of width 1024, 128,256 tokens, 0.37B
parameters), saved in bf16 with random weights under `--dir` once; its tokenizer is a word-level one
built here. Each run trains LoRA r=16 on every linear layer over one sample of `--seq` tokens, bf16,
in its own process: "plain" is transformers + peft with gradient checkpointing and SDPA attention
and torch's AdamW; "outcore" is `outcore train --model` with `--max-memory`. The kit watches every
process's resident memory and stops one that passes `--max-memory` (the plain peer has no such
bound of its own): its row says "over". The table gives, per kind and length, the medians over the
rounds of the peak RSS and of the seconds of the steps after the first (of the only step where
`--steps 1`; outcore's from its log.jsonl), each kind's longest context that trained, and what
`outcore estimate --max-seq` says of outcore's under the same bound.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import psutil

from outcore.runtime.sizes import human_bytes, parse_size
from outcore.tools.report import check_json_argument, peak_rss, table, write_json

SHAPE: dict[str, Any] = {"vocab_size": 128_256, "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 8,
         "num_attention_heads": 16, "num_key_value_heads": 8, "max_position_embeddings": 1 << 17,
         "rope_theta": 500_000.0, "tie_word_embeddings": False}
WORDS = [f"w{i}" for i in range(8000)]
KINDS = ("plain", "outcore")


def model_dir(root: str, shape: dict[str, Any] | None = None) -> str:
    """The Llama `shape` (default: `SHAPE`) saved once under `root` (bf16, random weights, a word-level
    tokenizer)."""
    path = os.path.join(root, "llama-context" if shape is None else "llama-context-small")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    torch.manual_seed(0)
    model: Any = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(shape or SHAPE)))
    model.to(torch.bfloat16).save_pretrained(path)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>",
                                         pad_token="</s>").save_pretrained(path)
    return path


def data_file(root: str, seq: int) -> str:
    """One sample of `seq` words (one token each) and its end-of-text token, as JSON lines."""
    path = os.path.join(root, f"sample-{seq}.jsonl")
    rnd = random.Random(seq)
    with open(path, "w") as f:
        f.write(json.dumps({"text": " ".join(rnd.choice(WORDS) for _ in range(seq))}) + "\n")
    return path


def plain_peer(model: str, data: str, seq: int, steps: int) -> dict:
    """transformers + peft, gradient checkpointing, SDPA: what a user without outcore runs."""
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation="sdpa")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.enable_input_require_grads()
    lora = peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                     task_type="CAUSAL_LM"))
    tok = transformers.AutoTokenizer.from_pretrained(model)
    ids = tok(json.loads(open(data).readline())["text"], return_tensors="pt").input_ids[:, :seq]
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-4)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = lora(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return {"seconds": times, "loss": float(loss.detach()), "tokens": int(ids.shape[1])}


def run_watched(cmd: list[str], bound: int | None, timeout: float) -> tuple[int, int, str]:
    """Run `cmd`; its return code, its peak RSS as sampled (with its children), and its output's
    tail. A process past `bound` is killed (return code -9)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, over = [0], [False]

    def watch() -> None:
        ps = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                rss = ps.memory_info().rss + sum(c.memory_info().rss for c in ps.children(recursive=True))
            except psutil.Error:
                break
            peak[0] = max(peak[0], rss)
            if bound is not None and rss > bound:
                over[0] = True
                proc.kill()
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    watcher.join()
    return (-9 if over[0] else proc.returncode), peak[0], out[-4000:]


def one_run(kind: str, model: str, root: str, seq: int, steps: int, bound: int | None, extra: list[str],
            timeout: float) -> dict:
    data = data_file(root, seq)
    report = os.path.join(root, f"{kind}-{seq}.json")
    if os.path.exists(report):
        os.remove(report)
    shutil.rmtree(os.path.join(root, f"run-{seq}"), ignore_errors=True)  # a round's run starts anew
    if kind == "plain":
        cmd = [sys.executable, "-m", "outcore.tools.kit.bench_context", "--peer", model, data, str(seq), str(steps),
               report]
    else:
        cmd = [sys.executable, "-m", "outcore.tools.cli", "train", "--model", model, "--lora", "16", "--data", data,
               "--eval-data", data, "--eval-batches", "1", "--seq", str(seq), "--batch", "1", "--steps", str(steps),
               "--dtype", "bf16", "--no-save", "--log-every", "1", "--out", os.path.join(root, f"run-{seq}"),
               "--json", report, *(["--max-memory", str(bound)] if bound else []), *extra]
    code, peak, tail = run_watched(cmd, bound, timeout)
    row = {"kind": kind, "seq": seq, "code": code, "peak_rss": peak, "seconds": None}
    if code == 0 and os.path.exists(report):
        got = json.load(open(report))
        if kind == "plain":
            seconds = got["seconds"][1:] or got["seconds"]
            row["seconds"] = statistics.median(seconds)
        else:  # each step's seconds from the run's log (its one row of --seq tokens a step), as plain's
            with open(os.path.join(root, f"run-{seq}", "log.jsonl")) as f:
                logged = [json.loads(line) for line in f]
            seconds = [seq / r["tokens_per_second"] for r in logged if "tokens_per_second" in r]
            row["seconds"] = statistics.median(seconds[1:] or seconds)
            row["activations_paged"] = got.get("activation_bytes_paged_per_step")
    else:
        row["why"] = "over --max-memory" if code == -9 else tail.strip().splitlines()[-1] if tail.strip() else ""
    return row


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--peer"]:
        _, model, data, seq, steps, report = argv
        with open(report, "w") as f:
            json.dump({**plain_peer(model, data, int(seq), int(steps)), "peak_rss": peak_rss()}, f)
        return 0
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m outcore.tools.kit.bench_context")
    ap.add_argument("--seqs", default="2048,4096,8192")
    ap.add_argument("--max-memory", default="6G")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--dir", default=".")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    check_json_argument(ap, args.json_path)
    bound = parse_size(args.max_memory) if args.max_memory not in ("", "none") else None
    seqs = [int(s) for s in args.seqs.split(",")]
    kinds = args.kinds.split(",")
    os.makedirs(args.dir, exist_ok=True)
    model = model_dir(args.dir)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for _ in range(args.rounds):
            for length in seqs:
                for kind in kinds:  # interleaved: each length's kinds side by side in each round
                    rows.append(one_run(kind, model, root, length, args.steps, bound, extra, args.timeout))
                    print(json.dumps(rows[-1]), flush=True)
    summary = summarize(rows, kinds, seqs)
    table(["kind", "--seq", "peak RSS", "s/step", "trained"],
          [[r["kind"], f"{r['seq']:,}", human_bytes(r["peak_rss"]),
            "-" if r["seconds"] is None else f"{r['seconds']:.2f}", r["trained"]] for r in summary["rows"]])
    for kind, seq_ in summary["longest"].items():
        print(f"{kind}: longest context trained under {args.max_memory}: {seq_ or 'none'}")
    estimated = estimated_longest(model, args.dir, bound) if "outcore" in kinds else None
    if estimated is not None:
        print(f"outcore estimate --max-seq under {args.max_memory}: {estimated:,}")
    if args.json_path:
        write_json(args.json_path, {**summary, "runs": rows, "max_memory": bound, "extra": extra,
                                    "estimated_longest": estimated})
    return 0


def estimated_longest(model: str, root: str, bound: int | None) -> int | None:
    """What `outcore estimate --max-seq` says of the same run (LoRA r=16, bf16, one row), to set
    beside the longest context measured; None where it could not say."""
    report = os.path.join(root, "estimate.json")
    cmd = [sys.executable, "-m", "outcore.tools.cli", "estimate", "--model", model, "--lora", "16", "--max-seq",
           "--dtype", "bf16", "--nvme-dir", root, "--json", report, *(["--max-memory", str(bound)] if bound else [])]
    if subprocess.run(cmd, capture_output=True, text=True).returncode != 0:
        return None
    with open(report) as f:
        return json.load(f).get("max_seq")


def summarize(rows: list[dict], kinds: list[str], seqs: list[int]) -> dict:
    out: list[dict] = []
    longest: dict[str, int] = {}
    for kind in kinds:
        for seq in seqs:
            runs = [r for r in rows if r["kind"] == kind and r["seq"] == seq]
            ok = [r for r in runs if r["code"] == 0]
            out.append({"kind": kind, "seq": seq, "peak_rss": statistics.median(r["peak_rss"] for r in runs),
                        "seconds": statistics.median(r["seconds"] for r in ok) if ok else None,
                        "trained": f"{len(ok)}/{len(runs)}" + ("" if ok else f" ({runs[0].get('why', '')[:60]})")})
            if ok:
                longest[kind] = max(longest.get(kind, 0), seq)
        longest.setdefault(kind, 0)
    return {"rows": out, "longest": longest}


if __name__ == "__main__":
    raise SystemExit(main())
