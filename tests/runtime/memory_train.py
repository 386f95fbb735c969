"""Run by test_memory.py in its own process: train a model whose fp32 states exceed 3 GB, report peak RSS."""

import json
import sys
import time

import torch
from torch import nn

import outcore
from outcore.tools.report import peak_rss


class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Stack(nn.Module):
    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def main(nvme_dir: str, d: int, layers: int, host_budget: int) -> None:
    torch.set_num_threads(2)
    with outcore.deferred_init():
        model = Stack(d, layers)
    n = sum(p.numel() for p in model.parameters())
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=nvme_dir,
                         host_budget=host_budget, prefetch_depth=1, io={"block_size": 8 << 20, "threads": 4})
    t0 = time.perf_counter()
    engine = outcore.Engine(model, cfg, outcore.AdamW(lr=1e-4))
    init_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    losses, step_s = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        loss = engine(torch.randn(8, d, generator=g) * 0.1)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        step_s.append(time.perf_counter() - t0)
    s = engine.stats()
    engine.close()
    print(json.dumps({"params": n, "fp32_state_bytes": 12 * n, "losses": losses, "init_s": init_s,
                      "step_s": step_s, "peak_rss": peak_rss(),
                      "bytes_read": s["bytes_read"], "bytes_written": s["bytes_written"],
                      "host_peak": s["host"]["peak"], "device_peak": s["device"]["peak"],
                      "nvme_bytes": s["nvme"]["bytes"]}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
