"""The rates a step's prediction (tools/step_estimate.py) divides by, measured on this machine now:
the compute of a micro-batch (on the model's own shape, or a transformer MLP's FLOP/s), the engine's
fixed costs a step and its per-parameter rate, the disk in the engine's I/O setting, a frozen base's
reads through the page cache, the CPU's AdamW and the swap file's checksums. Each is a short run
of its own, a few seconds at most.
"""

from __future__ import annotations

import os
import time

from outcore.runtime.policy import StatePolicy


def measure_flops(device: str, dtype: str, *, tokens: int = 2048, d_model: int = 2048, seconds: float = 2.0) -> float:
    """Model FLOP/s of a transformer MLP (d_model -> 4 d_model, GELU, back, a layer norm) in
    `dtype` on `device`, forward and backward over `tokens` rows: the model's own matrix shapes,
    with the elementwise work between them. The best of `seconds`."""
    import torch

    from outcore.runtime.policy import torch_dtype

    if device != "cpu" and not torch.cuda.is_available():
        raise ValueError("the compute rate of --device cuda cannot be measured on a machine with no CUDA device: "
                         "give --flops (and --peak-flops) to predict a GPU's step here, or --device cpu.")
    kind = torch_dtype(dtype)
    mlp = torch.nn.Sequential(torch.nn.LayerNorm(d_model), torch.nn.Linear(d_model, 4 * d_model), torch.nn.GELU(),
                              torch.nn.Linear(4 * d_model, d_model)).to(device=device, dtype=kind)
    x = torch.randn(tokens, d_model, device=device, dtype=kind, requires_grad=True)
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end or best == float("inf"):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        mlp(x).sum().backward()
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 6 * 8 * d_model * d_model * tokens / best


def measure_compute(device: str, dtype: str, *, layers: int, d_model: int, vocab: int, seq: int, batch: int,
                    checkpointing: bool = False, frozen: bool = False, repeats: int = 3) -> float:
    """Seconds one micro-batch's forward and backward take on the model's own shape, in plain
    PyTorch: a GPT of its width and vocabulary at the run's batch and sequence length, measured
    with one block and with up to four; the model is the first less a block, plus `layers` blocks (each
    block's attention, norms, activations and, with `checkpointing`, recomputation included; the
    head's loss too). `frozen`: the blocks take no weight gradient (a LoRA run's base)."""
    import statistics

    import torch

    from outcore.runtime.policy import torch_dtype
    from outcore.tools.gpt import GPT
    from outcore.tools.presets import GPTConfig

    heads = max(1, d_model // 64)
    while d_model % heads:
        heads -= 1
    kind = torch_dtype(dtype)

    def seconds(blocks: int) -> float:
        cfg = GPTConfig(vocab=vocab, seq=seq, layers=blocks, d_model=d_model, heads=heads)
        model = GPT(cfg, checkpoint_activations=checkpointing).to(device=device, dtype=kind)
        if frozen:
            model.requires_grad_(False)
            next(model.blocks[0].parameters()).requires_grad_(True)  # something to differentiate, as adapters are
        x = torch.randint(0, vocab, (batch, seq), device=device)
        times = []
        for _ in range(repeats + 1):
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(x, x).backward()
            if device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    deep = min(max(layers, 2), 4)
    one, more = seconds(1), seconds(deep)
    block = max(0.0, (more - one) / (deep - 1))
    return max(0.0, one - block) + layers * block


def measure_engine_costs(units: int, policy: StatePolicy, nvme_dir: str, *, frozen_share: float = 0.0,
                         steps: int = 3, wide: int = 256) -> tuple[float, float]:
    """What an engine step costs beyond its compute and bytes, at this many units under this
    setting: (seconds a step, whatever its size: Python, the hooks' gathers and releases, the I/O's
    requests; trained parameters a second its update path handles: the gradients' casts into their
    fp32 shards, the norm, AdamW, the copies back into the parameters). Measured on a GPT of `units`
    - 1 blocks at width 16 and at width `wide`, a step of 1 x 8 tokens (its compute negligible),
    the median of `steps` after one to warm up. `frozen_share`: the share of the blocks frozen (a
    LoRA run's base), which take no gradient or update."""
    small, small_trained = _engine_step_seconds(units, policy, nvme_dir, 16, frozen_share, steps)
    large, large_trained = _engine_step_seconds(units, policy, nvme_dir, wide, frozen_share, steps)
    rate = (large_trained - small_trained) / max(large - small, 1e-6)
    return small, rate


def _engine_step_seconds(units: int, policy: StatePolicy, nvme_dir: str, width: int, frozen_share: float,
                         steps: int) -> tuple[float, int]:
    import statistics
    import tempfile

    import torch

    from outcore.runtime import AdamW, Config, Engine, deferred_init
    from outcore.tools.gpt import GPT, init_fn
    from outcore.tools.presets import GPTConfig

    cfg = GPTConfig(vocab=256, seq=8, layers=max(1, units - 1), d_model=width, heads=2)
    with deferred_init():
        model = GPT(cfg)
    for block in list(model.blocks)[: round(frozen_share * cfg.layers)]:
        block.requires_grad_(False)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    os.makedirs(nvme_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=nvme_dir, prefix=".outcore-overhead-") as scratch:
        config = Config(stage=policy.stage, offload_params=policy.offload_params,
                        offload_optimizer=policy.offload_optimizer, dtype=policy.dtype, nvme_dir=scratch,
                        grad_clip=1.0 if policy.clipping else None)
        engine = Engine(model, config, AdamW(lr=1e-4), init_fn=init_fn(cfg))
        x = torch.randint(0, 256, (1, 8))
        times = []
        try:
            for _ in range(steps + 1):
                t0 = time.perf_counter()
                engine.backward(engine(x, x))
                engine.step()
                engine.synchronize()
                times.append(time.perf_counter() - t0)
        finally:
            engine.close()
    return statistics.median(times[1:]), trained


def measure_in_place_read(directory: str, size: int = 256 << 20) -> float:
    """Bytes/s a file is read as a frozen base is read in place: `preadv` through the page cache in
    pieces of 8 MiB, the pages dropped after (offload/file_source.py), from a file of `size` bytes
    written under `directory` (removed after) and dropped from the cache first."""
    import tempfile

    piece = 8 << 20
    buf = bytearray(piece)
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".outcore-read-") as f:
        block = os.urandom(piece)  # incompressible, as weights are
        for _ in range(size // piece):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        fd = f.fileno()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for offset in range(0, size, piece):
            os.preadv(fd, [buf], offset)
            os.posix_fadvise(fd, offset, piece, os.POSIX_FADV_DONTNEED)
        return size / (time.perf_counter() - t0)


def measure_adam(params: int = 1 << 23, repeats: int = 3) -> float:
    """Parameters/s of one fused AdamW call over fp32 states on the CPU, the best of `repeats`."""
    import torch

    p, g, m, v = (torch.randn(params) for _ in range(4))
    v.abs_()
    step = torch.tensor(1.0)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01,
                            eps=1e-8, amsgrad=False, maximize=False)
        best = min(best, time.perf_counter() - t0)
    return params / best


def measure_checksum(nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """Bytes/s the swap file's block checksum runs at on one core, the best of `repeats`."""
    import numpy as np

    from outcore.offload.checksum import block_checksum

    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        block_checksum(data.data)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def disk_rates(bench_json: dict) -> tuple[float, float]:
    """(read, write) bytes/s: the best settings of an `outcore bench-disk --json` file."""
    results = bench_json["results"]
    return (results[bench_json["best_read"]]["read_MBps"] * 1e6,
            results[bench_json["best_write"]]["write_MBps"] * 1e6)


def measure_disk(directory: str, size: int = 256 << 20) -> tuple[float, float]:
    """(read, write) bytes/s of `directory`'s disk in the engine's I/O setting, measured now."""
    from outcore.tools.bench_disk import bench_disk

    return disk_rates(bench_disk(directory, size=size, block_sizes=[8 << 20], queue_depths=[32], threads=[4],
                                 backends=["threads"], use_fio=False))
