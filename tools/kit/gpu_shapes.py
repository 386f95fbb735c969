"""The GPU kit's real model shapes: a Llama-8B-shaped full fine-tune and a Qwen-14B-shaped LoRA.

Each model is built from its architecture's config with random weights (nothing is downloaded) and
trained a few steps, in a process of its own so that its peak host RSS is its own:
- `llama-8b-full`: every parameter trained, bf16 compute, parameters on the GPU, the optimizer on
  the CPU with its states in bf16 (`Config.state_dtype`), the model's own activation checkpointing,
  and the accumulation at which the step estimate says compute bounds the step (at most
  `MAX_ACCUMULATION`, to keep the kit short);
- `qwen-14b-lora`: LoRA r=16 on every projection, the frozen base on NVMe, the adapters' optimizer
  on the CPU, under a 16 GiB device budget (a consumer card's), activation checkpointing;
- `llama-70b-qlora`: QLoRA, LoRA r=16 on a Llama-70B-shaped base stored NF4 in the tiers (quantized
  on the GPU as it streams in), in host memory where half of what is available holds it, else on
  NVMe, under a 22 GiB device budget (a 24 GB card's), bf16 compute;
- `llama-8b-lora-128k` and `llama-70b-qlora-32k`: long context, one sample of 131,072 and 32,768
  tokens a step under 24 and 22 GiB device budgets, the loss over chunks and the MLPs over tiles
  chosen by the engine (`Config.loss_chunk_tokens`/`tile_tokens="auto"`), the block inputs paged
  to host memory (`offload_activations="cpu"`);
- `llama-8b-grpo`: GRPO's sampling, LoRA r=16 on a Llama-8B shape whose 16 GB bf16 base rests in
  host memory, under an 8 GiB device budget: 8 completions of 256 new tokens for a prompt of 256
  tokens, generated in one call (`generation_row`), tokens/s and the bytes read a token.
Each row gives tokens/s, MFU, peak host RSS and bytes moved per step, with the estimate's
prediction (tools/step_estimate.py) beside it, from the rates the kit measured.

    python -m outcore.tools.kit.gpu_shapes ROW SPEC_JSON   (one row, in this process; the kit runs it)
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, cast

import psutil
import torch

MAX_ACCUMULATION = 16
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class ModelShape:
    """One row: an architecture's config, and how it is trained."""

    architecture: str  # "llama" or "qwen2"
    config: dict[str, int]
    lora: int | None  # adapter rank; None: a full fine-tune
    offload_params: str  # "auto": host memory where half of the available holds the stored parameters, else NVMe
    device_budget: int | None
    quantize: str | None = None  # Config.quantize of the frozen base
    seq: int | None = None  # the row's context; None: the kit's
    # a long-context row: one sample a step, the loss over chunks and MLP tiles chosen ("auto"), and
    # the block inputs kept for backward paged to host memory (issue 71)
    long_context: bool = False
    generations: int = 0  # a generation row (GRPO's sampling): completions a prompt; 0: a training row
    new_tokens: int = 0  # tokens each completion generates


SHAPES = {
    "llama-8b-full": ModelShape("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
                           lora=None, offload_params="none", device_budget=None),
    "qwen-14b-lora": ModelShape("qwen2", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                                         num_attention_heads=40, num_key_value_heads=8, vocab_size=152064),
                           lora=16, offload_params="nvme", device_budget=16 << 30),
    "llama-70b-qlora": ModelShape("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                           num_attention_heads=64, num_key_value_heads=8, vocab_size=128256),
                             lora=16, offload_params="auto", device_budget=22 << 30, quantize="nf4"),
    "llama-8b-lora-128k": ModelShape("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                              num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
                                lora=16, offload_params="cpu", device_budget=24 << 30, seq=131_072,
                                long_context=True),
    "llama-70b-qlora-32k": ModelShape("llama", dict(hidden_size=8192, intermediate_size=28672,
                                               num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                               vocab_size=128256),
                                 lora=16, offload_params="auto", device_budget=22 << 30, quantize="nf4",
                                 seq=32_768, long_context=True),
    "llama-8b-grpo": ModelShape("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
                           lora=16, offload_params="cpu", device_budget=8 << 30, seq=256, generations=8,
                           new_tokens=256),
}


def build(shape: ModelShape, overrides: dict[str, int] | None = None) -> tuple[torch.nn.Module, Any]:
    """The model on the meta device (the engine materializes it unit by unit), checkpointing on,
    and the architecture's own initialization of a module, random as from_config's."""
    import transformers

    from outcore.hf.model_info import hf_checkpointing
    from outcore.runtime.materialize import deferred_init

    kind = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[shape.architecture]
    config = kind(**{**shape.config, **(overrides or {})}, max_position_embeddings=max(8192, shape.seq or 0),
                  tie_word_embeddings=False)
    with deferred_init():
        model = transformers.AutoModelForCausalLM.from_config(config)
    enable = hf_checkpointing(model)
    assert enable is not None
    enable()
    init = model._init_weights
    if shape.lora is not None:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=shape.lora, lora_alpha=2 * shape.lora,
                                                           target_modules=PROJECTIONS, lora_dropout=0.0))
    return model, init


def config_of(shape: ModelShape, nvme_dir: str, accumulate: int, params: int = 0) -> Any:
    """The row's Config; `params`: the model's parameters, for an "auto" placement of them."""
    from outcore import runtime
    from outcore.runtime.quantized import bytes_per_weight

    offload = shape.offload_params
    if offload == "auto":
        stored = params * (bytes_per_weight(shape.quantize, True) if shape.quantize else 2)
        offload = "cpu" if stored <= psutil.virtual_memory().available // 2 else "nvme"
    return runtime.Config(stage=3, offload_params=offload, offload_optimizer="cpu", nvme_dir=nvme_dir,
                          dtype="bf16", state_dtype="bf16", grad_clip=1.0, grad_accumulation=accumulate,
                          device_budget=shape.device_budget, quantize=shape.quantize,
                          quantize_double=shape.quantize is not None,
                          loss_chunk_tokens="auto" if shape.long_context else None,
                          tile_tokens="auto" if shape.long_context else None,
                          offload_activations="cpu" if shape.long_context else "auto")


def predict(model: torch.nn.Module, shape: ModelShape, rates: Any, *, tokens: int, device_type: str,
            accumulate: int | None) -> tuple[Any, int, Any]:
    """The step estimate of this row: (its StepShape, the accumulation to run, the StepTime at it).
    `accumulate` None: the smallest at which compute bounds the step, at most MAX_ACCUMULATION."""
    from outcore.runtime.policy import StatePolicy
    from outcore.tools import step_estimate as se
    from outcore.tools.estimate import quantized_stored
    from outcore.tools.model_source import unit_layout

    units, layout = unit_layout(model)
    if shape.quantize is not None:  # its frozen blocks at their stored bytes
        layout["stored"] = quantized_stored(units, layout, 1, shape.quantize, True)

    def step_shape(k: int) -> se.StepShape:
        policy = StatePolicy.of(config_of(shape, ".", k), world=1, device_type=device_type)
        return se.plan_shape(units, layout, policy, tokens=tokens, device_budget=shape.device_budget,
                             host_budget=None, available=psutil.virtual_memory().available, checkpointing=True)[0]

    if accumulate is None:
        accumulate = min(se.compute_bound_accumulation(step_shape(1), rates, MAX_ACCUMULATION) or MAX_ACCUMULATION,
                         MAX_ACCUMULATION)
    at = step_shape(accumulate)
    return at, accumulate, se.predict_step(at, rates, accumulate)


def run_row(name: str, *, device: str, nvme_dir: str, rates: dict, batch: int, seq: int, steps: int,
            accumulate: int | None = None, overrides: dict[str, int] | None = None) -> dict:
    """Train row `name` for a warm-up step and `steps` timed ones; its figures beside the prediction."""
    from outcore import runtime
    from outcore.tools import step_estimate as se
    from outcore.tools.report import peak_rss

    shape = SHAPES[name]
    if shape.generations:
        return generation_row(name, device=device, nvme_dir=nvme_dir, batch=batch, seq=seq, overrides=overrides)
    if shape.long_context:  # one sample of the row's context a step (a test gives a shorter `seq`)
        accumulate = 1
    model, init = build(shape, overrides)
    vocab = int((overrides or {}).get("vocab_size", shape.config["vocab_size"]))
    machine = se.Rates(**rates)
    at, accumulate, predicted = predict(model, shape, machine, tokens=batch * seq,
                                        device_type=torch.device(device).type, accumulate=accumulate)
    with tempfile.TemporaryDirectory(dir=nvme_dir) as d:
        config = config_of(shape, d, accumulate, at.params)
        engine = runtime.Engine(model, config, runtime.AdamW(lr=1e-5), device=device, init_fn=init)
        try:
            gen = torch.Generator().manual_seed(0)
            times, before = [], engine.stats()
            first = before
            for step in range(steps + 1):
                _synchronize(engine.device)
                t0 = time.perf_counter()
                for _ in range(accumulate):
                    x = torch.randint(0, vocab, (batch, seq), generator=gen).to(engine.device)
                    engine.backward(engine(input_ids=x, labels=x, use_cache=False).loss)
                engine.step()
                engine.synchronize()
                _synchronize(engine.device)
                if step == 0:
                    first = engine.stats()  # the warm-up step records the unit order
                else:
                    times.append(time.perf_counter() - t0)
            last = engine.stats()
        finally:
            engine.close()
    step_s = sorted(times)[len(times) // 2]
    flops = se.step_flops(at, accumulate)
    return {"row": name, "params": at.params, "trained": at.trained, "batch": batch, "seq": seq,
            "accumulate": accumulate, "step_s": step_s, "tokens_per_s": batch * seq * accumulate / step_s,
            "model_TFLOPS": flops / step_s / 1e12,
            "MFU": flops / step_s / machine.peak_flops if machine.peak_flops else None,
            "peak_host_rss_bytes": peak_rss(),
            "gpu_peak_allocated_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
            "bytes_read_per_step": (last["bytes_read"] - first["bytes_read"]) / steps,
            "bytes_written_per_step": (last["bytes_written"] - first["bytes_written"]) / steps,
            "offload_params": config.offload_params, "quantize": config.quantize,
            "offload_activations": config.offload_activations,
            "activation_bytes_paged_per_step": last["activations"]["bytes_paged"],
            "predicted": predicted.as_dict(machine.peak_flops), "rates": dataclasses.asdict(machine)}


def generation_row(name: str, *, device: str, nvme_dir: str, batch: int, seq: int,
                   overrides: dict[str, int] | None = None) -> dict:
    """Generate as GRPO samples: `batch` prompts of `seq` tokens x the row's generations, its new
    tokens each, greedy, in one `generate` call, after one warm-up call (the cycle's order recorded
    and its kept units gathered: runtime/forward_cycle.py); tokens/s, the bytes read a token, and
    what the cycle keeps and streams."""
    from outcore import runtime
    from outcore.tools.report import peak_rss

    shape = SHAPES[name]
    model, init = build(shape, overrides)
    vocab = int((overrides or {}).get("vocab_size", shape.config["vocab_size"]))
    prompts = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    prompts = prompts.repeat_interleave(shape.generations, 0)
    with tempfile.TemporaryDirectory(dir=nvme_dir) as d:
        engine = runtime.Engine(model, config_of(shape, d, 1), runtime.AdamW(lr=1e-5), device=device, init_fn=init)
        try:
            engine.module.eval()
            x, module = prompts.to(engine.device), cast(Any, engine.module)  # a transformers model

            def generate() -> None:
                with torch.no_grad():
                    module.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                    max_new_tokens=shape.new_tokens, min_new_tokens=shape.new_tokens,
                                    pad_token_id=0)
                _synchronize(engine.device)

            generate()
            before, t0 = engine.stats(), time.perf_counter()
            generate()
            seconds, after = time.perf_counter() - t0, engine.stats()
            cycle = engine.lifecycle.cycle
            kept = 0 if cycle.plan is None else len(cycle.plan.kept)
            streamed = cycle.streamed_bytes()
        finally:
            engine.close()
    return {"row": name, "sequences": len(prompts), "prompt": seq, "new_tokens": shape.new_tokens,
            "s_per_token": seconds / shape.new_tokens,
            "tokens_per_s": len(prompts) * shape.new_tokens / seconds,
            "bytes_read_per_token": (after["bytes_read"] - before["bytes_read"]) / shape.new_tokens,
            "units_kept": kept, "units": len(engine.units), "streamed_bytes_per_token": streamed,
            "device_budget": shape.device_budget, "peak_host_rss_bytes": peak_rss(),
            "gpu_peak_allocated_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}


def deepspeed_note() -> str:
    """DeepSpeed ZeRO-3 beside these rows: what stands in its place here."""
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import is the answer
        return f"not run: deepspeed does not import here ({type(e).__name__}: {e})"
    return "not run: the kit's DeepSpeed run (tools/kit/bench_peers.py) trains outcore's GPT presets only"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    row, spec = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps(run_row(row, **spec)))
