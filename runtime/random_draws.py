"""What a train_batch's micro-batches draw at random, and the line that says so.

[Note: random draws] A model that draws random numbers in its forward (dropout) draws them here in
the vertical order: unit 0's masks for every micro-batch, then unit 1's, and so on, where K
separate forward passes draw all of micro-batch 0's first. The masks are as random and as
reproducible for a seed, but not the same ones, so the numbers then differ from those of
`backward()` accumulation; the engine says so once. The recomputation in backward replays each
unit's own draws (the checkpoint keeps the generator's state), so the gradients are those of the
masks the forward used: with K = 1 the result equals a plain step, dropout included.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

log = logging.getLogger("outcore.runtime.vertical")


class RandomDraws:
    """Notices a forward of K > 1 micro-batches that drew random numbers, and says once per
    engine that its numbers differ from K separate passes ([Note: random draws])."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.said = False

    @contextlib.contextmanager
    def watch(self, count: int) -> Iterator[None]:
        if self.said or count == 1:
            yield
            return
        before = self._states()
        yield
        if any(not torch.equal(a, b) for a, b in zip(before, self._states(), strict=True)):
            self.said = True
            log.warning("train_batch: the model draws random numbers in its forward (dropout), and draws them "
                        "unit by unit across the %d micro-batches, not micro-batch by micro-batch: the result is "
                        "as reproducible for a seed but not the same as %d backward() calls. Set dropout to 0 for "
                        "an exact comparison.", count, count)

    def _states(self) -> list[torch.Tensor]:
        states = [torch.get_rng_state()]
        if self.device.type == "cuda":
            states.append(torch.cuda.get_rng_state(self.device))
        return states
