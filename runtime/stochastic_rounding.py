"""Rounding fp32 to bf16 stochastically, for optimizer states kept in bf16 (`Config.state_dtype`).

Rounded to nearest, an update smaller than half a bf16 step (1/256 of the value) is lost every
time, and AdamW's late updates are mostly that small (the second moment moves by 0.1% a step). Rounded
up with a probability equal to the fraction of the step the value passed, it is kept on average:
the expected stored value is the fp32 one. The bits show how: a bf16 is the upper half of an fp32,
so adding a uniform random 16-bit number to the lower half and cutting it off rounds the magnitude
up exactly that often.

The random halves are cut from 64-bit draws, four from each: the generator is sequential, and one
draw per element made it most of the update's cost on a CPU. The fp32 copies an update works on and
the noise live in buffers reused from chunk to chunk (fresh ones fault in their pages every time).
Each rank draws from its own generator, seeded from the engine's seed and its rank; its state goes
into the rank's checkpoint file, so a resumed run draws what the uninterrupted one would.
"""

from __future__ import annotations

import torch

_UPPER_HALF = -65536  # 0xFFFF0000 as an int32: an fp32's bits that a bf16 keeps
_WORK_COPIES = 3  # a chunk's master, exp_avg and exp_avg_sq


class StochasticRounding:
    """Rounds fp32 values into bf16 tensors. Owns the generator it draws from (one per device) and
    the scratch of one chunk's update: used by one thread at a time, the optimizer's."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._scratch: dict[tuple[torch.device, str], torch.Tensor] = {}

    def widen(self, stored: torch.Tensor, slot: int) -> torch.Tensor:
        """An fp32 copy of bf16 `stored` to update, in scratch slot `slot` (0 to 2: a chunk's three)."""
        assert 0 <= slot < _WORK_COPIES
        work = self._buffer(stored.device, f"work{slot}", stored.numel(), torch.float32).view(stored.shape)
        work.copy_(stored)
        return work

    def round_into(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """`out` (bf16) := `values` (fp32, same shape) rounded stochastically."""
        assert out.dtype == torch.bfloat16 and values.dtype == torch.float32
        n, device = values.numel(), values.device
        draws = self._buffer(device, "draws", (n + 3) // 4, torch.int64)
        torch.randint(-(2**63), 2**63 - 1, draws.shape, dtype=torch.int64, out=draws,
                      generator=self._generator(device))
        noise = self._buffer(device, "noise", n, torch.int32)
        noise.copy_(draws.view(torch.int16)[:n])  # sign-extended: the mask below keeps the 16 bits
        noise.bitwise_and_(0xFFFF).add_(values.reshape(-1).view(torch.int32)).bitwise_and_(_UPPER_HALF)
        out.copy_(noise.view(torch.float32).view(values.shape))  # exact: the lower half is zero

    def state(self) -> torch.Tensor:
        """The CPU generator's state (what a checkpoint keeps; GPU updates draw on the device's)."""
        return self._generator(torch.device("cpu")).get_state()

    def load_state(self, state: torch.Tensor) -> None:
        self._generator(torch.device("cpu")).set_state(state.to(torch.uint8).cpu())

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def _buffer(self, device: torch.device, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The first `n` elements of scratch `name`, grown to the largest asked for."""
        buf = self._scratch.get((device, name))
        if buf is None or buf.numel() < n:
            buf = self._scratch[(device, name)] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]
