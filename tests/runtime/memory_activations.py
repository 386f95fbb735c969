"""Run by test_paged_activations.py in its own process: a checkpointed stack whose block inputs
(32 x 16 MiB) outweigh the store's HOST budget trains one step with its activations paged as asked;
prints the step's loss, what was paged, and the peak RSS above the process before the step."""

import json
import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import outcore
from outcore.tools.report import peak_rss

ROWS, WIDTH, LAYERS = 1 << 16, 64, 32  # each block input 16 MiB in fp32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x.square().mean()


def main(nvme_dir: str, mode: str) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=nvme_dir,
                         host_budget=96 << 20, offload_activations=mode)
    engine = outcore.Engine(Stack(), cfg, outcore.AdamW(lr=1e-3))
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1))
    before = peak_rss()
    loss = engine(x)
    engine.backward(loss)
    engine.step()
    grown = peak_rss() - before
    acts = engine.stats()["activations"]
    engine.close()
    print(json.dumps({"loss": float(loss.detach()), "grown": grown, "activations": acts}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
