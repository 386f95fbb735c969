"""Fine-tuning a pretrained model larger than the budgets: load it with `weights=` and train a few
LoRA and full steps with parameters and optimizer states on NVMe.

    python -m outcore.tools.kit.bench_pretrained --dir D [--layers 28] [--hidden 2048] [--steps 3]
                                             [--budget 256M] [--kinds load,lora,full,plain-lora,trainer]
                                             [--lora-init pissa] [--dora]
                                             [--intermediate 11008] [--kv-heads 32]

A Llama-shaped model (about 1.5B parameters at the defaults; `--layers 32 --hidden 4096
--intermediate 11008 --kv-heads 32` is Llama-7B's shape) is written once with random bf16 weights,
a tensor at a time, as safetensors shards in D/model beside a small tokenizer trained here (its size
is checked against the free space first). Each kind then runs in its own process, so that its peak RSS is its own:
`load` builds the engine (weights streamed into the tiers) and times it; `lora` and `full` run
`--steps` steps of LoRA (rank 16 on every linear layer) and of full fine-tuning; `plain-lora` is
transformers + peft with the whole model in RAM, the reference where it fits; `trainer` is `lora`
through TRL's SFTTrainer (`outcore_trainer(trl.SFTTrainer)`, the same config, data and adapters),
to be read against `lora`: what the Trainer integration costs. After its steps each
LoRA kind writes the model with its adapters merged in, timed, with the peak RSS of that alone:
`engine.export(dir, merge_adapters=True)`, against peft's `merge_and_unload()` and `save_pretrained`.
`--checkpoint` turns on the model's own activation checkpointing (non-reentrant) in every kind.
`--dtype fp32` computes in fp32 (the default, bf16, needs a CPU with native bf16 to be quick).
`--fused-head` computes the `lora` kind's loss through TRL's fused LM head, as SFTTrainer always does
(chunked log-probabilities, no full logits): the `lora` run that `trainer` is the same run as.
`--lora-init` (peft's `init_lora_weights`) and `--dora` set up both LoRA kinds' adapters: under the
engine they are computed as each unit's weights are read, so `load_s` is their cost. One JSON line
per kind.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import torch

from outcore.hf.model_info import hf_checkpointing
from outcore.tools.arg_types import parse_size, positive_int
from outcore.tools.report import peak_rss

KINDS = ("load", "lora", "full", "plain-lora", "trainer")


def _restart_peak() -> None:
    """Start the peak-RSS count (VmHWM) afresh, so that a phase's own peak can be read."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _merged_export(write, directory: str) -> dict:
    """Time `write(directory)` and its own peak RSS; the directory is removed after."""
    _restart_peak()
    t0 = time.perf_counter()
    write(directory)
    seconds = time.perf_counter() - t0
    written = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    shutil.rmtree(directory)
    return {"merge_export_s": seconds, "merge_export_peak_rss": peak_rss(), "merge_export_bytes": written}


def _checkpointing(model: torch.nn.Module) -> None:
    enable = hf_checkpointing(model)
    assert enable is not None, "a Hugging Face model checkpoints its activations itself"
    enable()


def make_model(directory: str, layers: int, hidden: int, *, intermediate: int | None = None,
               kv_heads: int | None = None) -> str:
    """A Llama-shaped model of random bf16 weights in `directory`/model, written a tensor at a time
    (a 7B shape never needs its 13.5 GB in memory), with a word-level tokenizer trained here, so that
    `outcore train --model` runs on it too."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = os.path.join(directory, "model")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    heads = hidden // 128
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden,
                         intermediate_size=intermediate or int(hidden * 2.75) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads or hidden // 256,
                         max_position_embeddings=2048, tie_word_embeddings=False, dtype="bfloat16")
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    need = 2 * sum(math.prod(s) for s in shapes.values()) * 1.1
    free = shutil.disk_usage(directory).free
    if free < need + (20 << 30):
        raise SystemExit(f"{directory}: {free / 2**30:.1f} GiB free; the model needs {need / 2**30:.1f} GiB "
                         "and its swap files about 8x that")
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    _save_tokenizer(path)
    generator = torch.Generator().manual_seed(0)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():  # shards of at most 2 GB, as save_pretrained cuts them
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > 2 << 30:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shapes[name], dtype=torch.bfloat16)
            else:
                tensors[name] = (torch.randn(shapes[name], generator=generator) * 0.02).to(torch.bfloat16)
            weight_map[name] = file
        save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
        del tensors
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


def _save_tokenizer(path: str) -> None:
    """A word-level tokenizer trained on a few lines of text (nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = "the quick brown fox jumps over the lazy dog and the small cat sleeps near the warm fire " * 4
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(path)


def run(kind: str, model_dir: str, scratch: str, steps: int, budget: int, checkpoint: bool,
        lora_init: str | None = None, dora: bool = False, fused_head: bool = False, dtype: str = "bf16") -> dict:
    merged_dir = os.path.join(os.path.dirname(scratch), "merged")
    import peft
    import transformers

    import outcore

    torch.manual_seed(0)
    x = torch.randint(0, 32000, (1, 128))
    init: Any = lora_init or True  # peft types the names it knows as literals
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0,
                           init_lora_weights=init, use_dora=dora)
    if kind == "plain-lora":
        t0 = time.perf_counter()
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        if checkpoint:
            _checkpointing(base)
        model = peft.get_peft_model(base, lora)
        load = time.perf_counter() - t0
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        peak = peak_rss()
        merge_and_unload = getattr(model, "merge_and_unload")  # noqa: B009 - a method mypy sees as a Tensor
        merged = _merged_export(lambda d: merge_and_unload().save_pretrained(d), merged_dir)
        return {"kind": kind, "load_s": load, "step_s": times, "peak_rss": peak, **merged}
    config = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=scratch,
                            dtype=dtype, grad_clip=1.0, device_budget=budget, host_budget=budget,
                            sub_group_size=1 << 20,  # the optimizer's HOST window: a few 16 MiB chunks
                            io=outcore.IOConfig(block_size=8 << 20, threads=4))
    if kind == "trainer":
        return _through_trainer(model_dir, x, lora, config, steps, checkpoint)
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    with outcore.deferred_init():
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    if checkpoint:
        _checkpointing(model)
    if fused_head:
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))  # what SFTTrainer adds
    if kind == "lora":
        with outcore.deferred_init():  # the adapters too: the engine computes them as it reads the weights
            model = peft.get_peft_model(model, lora)
    t0 = time.perf_counter()
    engine = outcore.Engine(model, config, outcore.AdamW(lr=1e-4), weights=model_dir)
    load = time.perf_counter() - t0
    load_rss = peak_rss()
    times = []
    for _ in range(steps if kind != "load" else 0):
        t0 = time.perf_counter()
        engine.backward(engine(input_ids=x, labels=x, **({"fused_lm_head": True} if fused_head else {})).loss)
        engine.step()
        engine.synchronize()
        times.append(time.perf_counter() - t0)
    s = engine.stats()
    peak = peak_rss()
    merged = _merged_export(lambda d: engine.export(d, merge_adapters=True), merged_dir) if kind == "lora" else {}
    engine.close()
    return {"kind": kind, "load_s": load, "load_peak_rss": load_rss, "step_s": times, "peak_rss": peak,
            "bytes_read": s["bytes_read"], "bytes_written": s["bytes_written"], **merged}


def _through_trainer(model_dir: str, x: torch.Tensor, lora: Any, config: Any, steps: int, checkpoint: bool) -> dict:
    """The `lora` kind's run through TRL's SFTTrainer on outcore: the same rows (pre-tokenized, every
    token trained), the same adapters, config and AdamW settings; each step timed by a callback."""
    import datasets
    import transformers
    import trl
    from tokenizers import Tokenizer, models

    from outcore.hf import outcore_trainer

    class StepTimes(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.times.append(time.perf_counter() - self.t0)

    # The rows are token ids already; the trainer wants a tokenizer only for its pad token.
    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2}
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                               pad_token="<pad>", unk_token="<unk>", eos_token="</s>")
    rows = datasets.Dataset.from_dict({"input_ids": [x[0].tolist()] * steps})
    run_dir = os.path.join(os.path.dirname(config.nvme_dir), "trainer-run")
    args = trl.SFTConfig(output_dir=run_dir, max_steps=steps,
                         per_device_train_batch_size=1, gradient_accumulation_steps=1, learning_rate=1e-4,
                         weight_decay=1e-2, max_grad_norm=1.0, lr_scheduler_type="constant",
                         bf16=config.dtype == "bf16",
                         gradient_checkpointing=checkpoint, max_length=x.shape[1], logging_steps=1,
                         save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0)
    timer = StepTimes()
    t0 = time.perf_counter()
    trainer = outcore_trainer(trl.SFTTrainer)(model=model_dir, args=args, train_dataset=rows, processing_class=tok,
                                              peft_config=lora, outcore_config=config, callbacks=[timer])
    load = time.perf_counter() - t0
    load_rss = peak_rss()
    trainer.train()
    s = trainer.engine.stats()
    peak = peak_rss()
    trainer.engine.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"kind": "trainer", "load_s": load, "load_peak_rss": load_rss, "step_s": timer.times, "peak_rss": peak,
            "bytes_read": s["bytes_read"], "bytes_written": s["bytes_written"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m outcore.tools.kit.bench_pretrained")
    p.add_argument("--dir", required=True)
    p.add_argument("--layers", type=positive_int, default=28)
    p.add_argument("--hidden", type=positive_int, default=2048, help="a multiple of 256 (heads of 128, 2 per KV head)")
    p.add_argument("--intermediate", type=positive_int, help="the MLP's width (default: 2.75x --hidden)")
    p.add_argument("--kv-heads", type=positive_int, help="key/value heads (default: one per two heads of 128)")
    p.add_argument("--steps", type=positive_int, default=3)
    p.add_argument("--budget", type=parse_size, default=256 << 20, help="DEVICE and HOST budget each")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--checkpoint", action="store_true", help="the model's own activation checkpointing")
    p.add_argument("--lora-init", help="peft's init_lora_weights for the LoRA kinds (pissa, olora, ...)")
    p.add_argument("--dora", action="store_true", help="DoRA adapters for the LoRA kinds")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="the compute dtype (default bf16)")
    p.add_argument("--fused-head", action="store_true", help="the lora kind's loss through TRL's fused LM head")
    p.add_argument("--_run", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.hidden % 256:
        p.error(f"--hidden {args.hidden}: give a multiple of 256 (attention heads of 128, two per key/value head)")
    unknown = set(args.kinds.split(",")) - set(KINDS)
    if unknown:
        p.error(f"--kinds {args.kinds}: choose from {', '.join(KINDS)}")
    os.makedirs(args.dir, exist_ok=True)
    model_dir = os.path.join(args.dir, "model")
    if args._run:
        scratch = os.path.join(args.dir, "swap")
        print(json.dumps({**run(args._run, model_dir, scratch, args.steps, args.budget, args.checkpoint,
                                args.lora_init, args.dora, args.fused_head, args.dtype),
                          "checkpoint": args.checkpoint, "lora_init": args.lora_init, "dora": args.dora,
                          "fused_head": args.fused_head, "dtype": args.dtype}))
        return
    t0 = time.perf_counter()
    make_model(args.dir, args.layers, args.hidden, intermediate=args.intermediate, kv_heads=args.kv_heads)
    print(json.dumps({"kind": "make", "seconds": time.perf_counter() - t0,
                      "bytes": sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir))}),
          flush=True)
    for kind in args.kinds.split(","):
        cmd = [sys.executable, "-m", "outcore.tools.kit.bench_pretrained", "--dir", args.dir, "--steps",
               str(args.steps), "--budget", str(args.budget), "--_run", kind]
        cmd += (["--checkpoint"] if args.checkpoint else []) + (["--lora-init", args.lora_init] if args.lora_init
                                                                else []) + (["--dora"] if args.dora else [])
        cmd += (["--fused-head"] if args.fused_head else []) + ["--dtype", args.dtype]
        res = subprocess.run(cmd, capture_output=True, text=True)
        line = res.stdout.strip().splitlines()[-1] if res.returncode == 0 else json.dumps(
            {"kind": kind, "error": res.stderr.strip().splitlines()[-1:]})
        print(line, flush=True)


if __name__ == "__main__":
    main()
