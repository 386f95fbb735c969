"""Whether a backward pass the caller ran itself (`loss.backward()`) finished, or raised partway.

The engine hears of a plain backward only through its hooks, and of its end only at its next call
(`UnitLifecycle.in_backward`). To tell the two apart it queues a callback on each autograd graph task its
hooks run in: autograd runs a task's callbacks when the task finishes, and never when it raises. A
reentrant activation checkpoint runs a nested task inside the pass, which may finish while the
outer one then fails; so the forward's outputs also get a pre-hook, which runs in the outer task
itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves


class BackwardWatch:
    """The graph tasks of the current backward pass that have not finished yet."""

    def __init__(self) -> None:
        self._open: set[int] = set()

    def enter(self) -> None:
        """Called from inside a backward pass (any hook): watch its graph task."""
        task = torch._C._current_graph_task_id()
        if task < 0 or task in self._open:
            return
        self._open.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._open.discard(task))

    def arm(self, output: Any) -> None:
        """Watch the backward pass that will start from `output` (a forward's result)."""
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                tensor.grad_fn.register_prehook(lambda _grads: self.enter())

    @property
    def finished(self) -> bool:
        """Every graph task entered since the last `forget` finished."""
        return not self._open

    def forget(self) -> None:
        self._open.clear()
