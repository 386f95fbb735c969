"""Dynamic loss scaling for fp16: scale up while steps are finite, halve and skip on overflow."""

from __future__ import annotations


class LossScaler:
    """The same policy as torch.amp.GradScaler's defaults: start 2^16, x2 every 2000 good steps."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self._good_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale / 2.0, 1.0)
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps % self.growth_interval == 0:
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._good_steps = float(state["scale"]), int(state["good_steps"])
