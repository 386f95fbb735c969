"""Rounding fp32 to bf16 stochastically, for optimizer states kept in bf16 (`Config.state_dtype`).

Rounded to nearest, an update smaller than half a bf16 step (1/256 of the value) is lost every
time, and AdamW's late updates are mostly that small. Rounded up with a probability equal to the
fraction of the step the value passed, it is kept on average: the expected stored value is the
fp32 one. The bits show how: a bf16 is the upper half of an fp32, so adding a uniform random
16-bit number to the lower half and cutting it off rounds the magnitude up exactly that often.

Each rank draws from its own generator, seeded from the engine's seed and its rank; its state goes
into the rank's checkpoint file, so a resumed run draws what the uninterrupted one would.
"""

from __future__ import annotations

import torch

_UPPER_HALF = -65536  # 0xFFFF0000 as an int32: an fp32's bits that a bf16 keeps


class StochasticRounding:
    """Rounds fp32 values into bf16 tensors; owns the generator it draws from, one per device."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def round_into(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """`out` (bf16) := `values` (fp32, same shape) rounded stochastically."""
        assert out.dtype == torch.bfloat16 and values.dtype == torch.float32
        bits = torch.randint(0, 1 << 16, values.shape, dtype=torch.int32, device=values.device,
                             generator=self._generator(values.device))
        bits.add_(values.view(torch.int32)).bitwise_and_(_UPPER_HALF)
        out.copy_(bits.view(torch.float32))  # exact: the lower half is zero

    def state(self) -> torch.Tensor:
        """The CPU generator's state (what a checkpoint keeps; GPU updates draw on the device's)."""
        return self._generator(torch.device("cpu")).get_state()

    def load_state(self, state: torch.Tensor) -> None:
        self._generator(torch.device("cpu")).set_state(state.to(torch.uint8).cpu())

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]
