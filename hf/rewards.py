"""What GRPO's and RLOO's reward functions gave a step, checked as the trainer computes it: a function
that returned None (or NaN) for every completion is said once by name, and a step in which no
function rewarded any completion is refused (TRL sums the rewards ignoring NaN, so such a step would
train on rewards of 0 without a word)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)


def check_rewards(rewards: torch.Tensor, names: Sequence[str], said: set[str]) -> None:
    """`rewards`: (completions, reward functions), as TRL's `_calculate_rewards` returns it; `said`:
    the names already said, grown here."""
    empty = torch.isnan(rewards).all(dim=0).tolist()
    if rewards.numel() and all(empty):
        raise ValueError(f"every reward function ({', '.join(names)}) returned None or NaN for each of the "
                         f"{rewards.shape[0]} completions of this step: no completion has a reward to learn from. "
                         "Make each function return a number for the completions it judges.")
    for name, none in zip(names, empty, strict=True):
        if none and name not in said:
            said.add(name)
            log.warning("reward function %s returned None or NaN for each of the %d completions of a step; the "
                        "other functions' rewards were used", name, rewards.shape[0])
