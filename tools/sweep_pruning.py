"""What the step prediction lets `outcore tune` leave out of its sweep.

Each candidate costs a fresh process and a few steps in every round; a candidate the prediction
(tools/step_estimate.py) shows cannot win is not run:
- a host budget the engine would refuse (below the memory plan's smallest), or one whose predicted
  step is slower than the best so far beyond the prediction's own error (20%): a smaller budget
  wins only at the same speed;
- the disk's settings (block size, queue depth, threads) on a GPU machine where the step, predicted
  with the disk twice as fast as measured, gains less than the tuner's noise floor (2%): the bytes
  already hide under compute. On a CPU-only machine they are always swept, since the I/O's own
  CPU work shares the cores compute needs, and the prediction counts only its checksums.
The prefetch depth and the threads' priority are always swept: the prediction does not model them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from outcore import runtime
from outcore.runtime.memory_plan import MemoryPlan, plan_memory, unit_shapes
from outcore.runtime.policy import StatePolicy
from outcore.runtime.sizes import human_bytes
from outcore.tools import machine_rates
from outcore.tools import step_estimate as se

PREDICTION_ERROR = 0.20  # docs/benchmarks.md, "The step predicted"
NOISE_FLOOR = 0.02  # the tuner's own: a candidate must beat the best by more


@dataclass
class SweepPruner:
    units: list[int]  # parameters per fetch unit
    layout: dict  # `unit_layout`'s: frozen units, roots, shared and outer modules
    tokens: int  # of one micro-batch
    rates: se.Rates
    device_type: str
    available: int  # host memory the budgets are derived from when a config gives none

    @classmethod
    def measured(cls, base: runtime.Config, model_spec: str, *, batch: int, seq: int | None) -> SweepPruner:
        """The model's layout, and this machine's rates measured now (disk in `base.nvme_dir`)."""
        import psutil
        import torch

        from outcore.tools.model_source import resolve_model, source_layout

        source = resolve_model(model_spec, seq=seq)
        units, layout = source_layout(source)
        seq = seq or (source.gpt.seq if source.gpt is not None else 128)
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        unbounded = (float("inf"), float("inf"))
        read, write = machine_rates.measure_disk(base.nvme_dir, 64 << 20) if base.nvme_dir else unbounded
        flops = machine_rates.measure_flops(device_type, base.dtype, tokens=batch * seq, seconds=1.0)
        cpu = device_type == "cpu"
        rates = se.Rates(disk_read=read, disk_write=write, flops=flops, adam=machine_rates.measure_adam(),
                         host_device=None if cpu else 25e9, checksum=machine_rates.measure_checksum() if cpu else None)
        return cls(units, layout, batch * seq, rates, device_type, psutil.virtual_memory().available)

    def plan(self, config: runtime.Config) -> tuple[StatePolicy, list[bool], MemoryPlan]:
        """`config`'s policy, the frozen units and its memory plan for this model."""
        policy = StatePolicy.of(config, world=1, device_type=self.device_type)
        frozen = self.layout.get("frozen") or [False] * len(self.units)
        shapes = unit_shapes(self.units, policy, frozen=frozen, roots=self.layout.get("roots"),
                             modules=self.layout.get("modules"), outer=self.layout.get("outer"))
        return policy, frozen, plan_memory(shapes, policy)

    def predict(self, config: runtime.Config, rates: se.Rates | None = None) -> se.StepTime:
        """The step of `config`; ValueError where the engine would refuse its budgets."""
        policy = StatePolicy.of(config, world=1, device_type=self.device_type)
        shape, _, _ = se.plan_shape(self.units, self.layout, policy, tokens=self.tokens,
                                    device_budget=config.device_budget, host_budget=config.host_budget,
                                    available=self.available)
        return se.predict_step(shape, rates or self.rates, config.grad_accumulation)

    def skip_io(self, config: runtime.Config) -> str | None:
        """Why the disk's settings cannot matter to `config`'s step; None where they can."""
        if self.rates.cpu_only:
            return None
        now = self.predict(config)
        faster = self.predict(config, dataclasses.replace(self.rates, disk_read=2 * self.rates.disk_read,
                                                          disk_write=2 * self.rates.disk_write))
        if faster.step < (1 - NOISE_FLOOR) * now.step:
            return None
        return (f"predicted NVMe {now.nvme:.3f} s of a {now.step:.3f} s step bound by {now.bound}: twice the "
                f"disk's rate would gain under {100 * NOISE_FLOOR:.0f}%")

    def skip_host_budget(self, best: runtime.Config, candidate: runtime.Config) -> str | None:
        """Why `candidate`'s smaller host budget cannot win against `best`; None where it can."""
        try:
            theirs = self.predict(candidate)
        except ValueError:
            least = human_bytes(self.plan(candidate)[2].host_min)
            return f"below the smallest host budget the engine accepts for this model ({least})"
        ours = self.predict(best)
        if theirs.step > (1 + PREDICTION_ERROR) * ours.step:
            return (f"predicted {theirs.step:.3f} s/step against {ours.step:.3f} s: slower beyond the prediction's "
                    f"{100 * PREDICTION_ERROR:.0f}% error")
        return None

