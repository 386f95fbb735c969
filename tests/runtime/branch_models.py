"""A model some of whose parameters get no gradient in some steps: `gate` (small, so it sits in the
root unit beside parameters that do get one) and block 1 (a unit of its own) join only for the
samples whose first feature is positive. With none such in a batch, torch.optim skips them. `pre`
comes first in the root unit and is just short of a shard's 1024 elements, so that on two ranks
the gate lies across the two shards."""

import torch
from torch import nn

DIM = 32


class BranchNet(nn.Module):
    """`every_unit`: block 1 runs on every batch, on no rows where none takes the branch (its
    parameters then get a zero gradient, not None); only the gate's get none."""

    def __init__(self, every_unit: bool = False) -> None:
        super().__init__()
        self.every_unit = every_unit
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))
        self.pre = nn.Linear(DIM, DIM - 1)
        self.gate = nn.Linear(DIM, 2)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.blocks[0](x)) + self.pre(x).sum(-1, keepdim=True)
        chosen = x[:, 0] > 0
        rows = chosen.nonzero().squeeze(1)
        if self.every_unit:
            h = h.index_add(0, rows, torch.relu(self.blocks[1](h[rows])))
        if bool(chosen.any()):  # the branch, per sample: the same sum on one rank or split over two
            extra = self.gate(h[rows]).sum(-1, keepdim=True).expand(-1, DIM)
            if not self.every_unit:
                extra = extra + torch.relu(self.blocks[1](h[rows]))
            h = h.index_add(0, rows, extra)
        h = torch.relu(self.blocks[2](h))
        return self.head(h).pow(2).sum() / 4  # a sum over the global batch of 4, whichever rank holds a row


def batch(step: int, taken: bool, rows: slice = slice(0, 4)) -> torch.Tensor:
    """Batch `step` of 4 rows; with `taken`, the branch runs for row 0 only, else for none."""
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(step))
    x[:, 0] = -x[:, 0].abs() - 0.1
    if taken:
        x[0, 0] = 1.0
    return x[rows]
