"""AdamW's step counts, per parameter as torch.optim keeps them.

torch.optim skips a parameter whose `.grad` is None (a branch the step did not take, an expert no
token reached, a vision tower on a text-only batch): no weight decay, no moment update, and its own
step count stays where it was, so its bias correction differs from its neighbours' from then on.
The engine updates a unit's flat shard chunk by chunk, so it keeps the same account: the updates
each unit took, and for each of its parameters (slots) the updates it sat out. A parameter without
a gradient in a step is cut out of its chunks' fused call (`idle`), and one that sat out earlier
updates takes its own step count there. A unit no parameter of which sat out, the usual case,
updates as one range with the unit's count.
"""

from __future__ import annotations

from collections.abc import Iterable


class StepCounts:
    """Updates taken, by unit; and, by unit and slot, updates sat out (only units with some)."""

    def __init__(self, units: int) -> None:
        self.units = [0] * units
        self.sat_out: dict[int, list[int]] = {}

    def of(self, unit: int, slot: int) -> int:
        """Updates slot `slot` of unit `unit` has taken."""
        missed = self.sat_out.get(unit)
        return self.units[unit] - (missed[slot] if missed is not None else 0)

    def uniform(self, unit: int) -> bool:
        """Every parameter of the unit has taken every one of its updates."""
        return unit not in self.sat_out

    def advance(self, unit: int, slots: int, idle: Iterable[int] = ()) -> None:
        """The unit took an update, which the slots in `idle` (of its `slots`) sat out."""
        self.units[unit] += 1
        idle = list(idle)
        if idle:
            missed = self.sat_out.setdefault(unit, [0] * slots)
            for s in idle:
                missed[s] += 1

    def state_dict(self) -> dict[str, object]:
        """The counts as a checkpoint's meta.json keeps them."""
        return {"unit_steps": list(self.units),
                "sat_out": {str(u): list(m) for u, m in sorted(self.sat_out.items())}}

    def load_state_dict(self, meta: dict) -> None:
        """From a checkpoint's meta.json (one written before `sat_out` has none: nothing sat out)."""
        units = [int(n) for n in meta["unit_steps"]]
        assert len(units) == len(self.units)  # the layout matched
        self.units[:] = units
        self.sat_out = {int(u): [int(n) for n in m] for u, m in (meta.get("sat_out") or {}).items()}
