"""Trainers that generate their own completions (TRL's GRPO and RLOO), generating through the engine.

Between optimizer steps they call `generate` on the policy. Under outcore that is the engine's
model: its hooks gather each unit for each forward, so every new token runs the whole model and
reads again whatever of it the device tier does not hold. That is slow beside a model that sits
whole on one GPU, and it is said once at the start of `train()`; README's GRPO section has the
figures. What would hold a second copy of the weights outside the tiers is refused:

- vLLM (`use_vllm=True`) keeps the whole model on the GPU;
- `sync_ref_model=True` mixes the policy's weights into the reference's in place, and both rest in
  the engines' tiers;
- transformers' continuous batching (`use_transformers_continuous_batching=True`) runs its own paged
  cache and kernels, which the engine's hooks are not tested under.
"""

from __future__ import annotations

from typing import Any

from outcore.hf.trained_model import parameter_counts
from outcore.runtime.engine import Engine
from outcore.runtime.sizes import human_bytes

GENERATING = ("GRPOTrainer", "RLOOTrainer")  # TRL's trainers that sample completions from the policy


def generates(trainer: type) -> bool:
    return any(c.__name__ in GENERATING for c in trainer.__mro__)


def generation_refusals(args: Any) -> list[str]:
    """The settings of a generating trainer outcore cannot honour, each as the sentence that says so."""
    out = []
    if getattr(args, "use_vllm", False):
        out.append("use_vllm=True: vLLM holds the whole model on the GPU, which outcore exists not to need; "
                   "leave it False, and completions are generated through the engine.")
    if getattr(args, "use_transformers_continuous_batching", False):
        out.append("use_transformers_continuous_batching=True: its paged cache and kernels are not tested under "
                   "the engine's hooks; leave it False.")
    if getattr(args, "sync_ref_model", False):
        out.append("sync_ref_model=True: TRL mixes the policy's weights into the reference's in place, and both rest "
                   "in outcore's tiers; leave it False.")
    return out


def generation_note(engine: Engine) -> str:
    _, total = parameter_counts(engine)
    device = engine.stats()["device"]["budget"]
    return (f"outcore: completions are generated through the engine: each new token runs the whole model "
            f"({total / 1e6:.1f}M parameters) and reads again what the device tier ({human_bytes(device)}) does not "
            "hold, so generating is slower than on a model whole on one GPU (README: GRPO)")
