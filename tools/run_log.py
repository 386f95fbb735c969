"""What `outcore train` records as it runs: `OUT/log.jsonl`, always, and the trackers `--report-to`
names (TensorBoard event files under `OUT/tensorboard`; W&B, offline unless the environment says
otherwise, under `OUT/wandb`). Rank 0 writes; a row per `--log-every` steps, one more for each
evaluation, each flushed as it is written, so that a run under nohup or a scheduler can be read
(`tail -f OUT/log.jsonl`) while it goes on and after it was killed.

A row: step, loss (the mean over the steps since the last row), lr, grad_norm, tokens_per_second,
tokens (processed so far), io_wait_seconds (so far), bytes in each tier (device, host, nvme), and
eval_loss on the rows of an evaluation.
"""

from __future__ import annotations

import json
import os
from typing import Any

from outcore.runtime.formats.written_files import open_appending

TRACKERS = ("tensorboard", "wandb")


class RunLog:
    def __init__(self, out: str, *, report_to: tuple[str, ...] = (), config: dict[str, Any] | None = None,
                 enabled: bool = True, resume: bool = False) -> None:
        unknown = set(report_to) - set(TRACKERS)
        if unknown:
            raise ValueError(f"--report-to {','.join(sorted(unknown))}: choose from {', '.join(TRACKERS)}.")
        self.enabled = enabled
        self._file = None
        self._tensorboard: Any = None
        self._wandb: Any = None
        if not enabled:
            return
        os.makedirs(out, exist_ok=True)
        fd = open_appending(os.path.join(out, "log.jsonl"), truncate=not resume)  # no link followed
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ValueError("--report-to tensorboard needs the tensorboard package: pip install "
                                 "'outcore[log]'.") from e
            self._tensorboard = SummaryWriter(os.path.join(out, "tensorboard"))
        if "wandb" in report_to:
            try:
                import wandb
            except ImportError as e:
                raise ValueError("--report-to wandb needs the wandb package: pip install 'outcore[log]'.") from e
            os.environ.setdefault("WANDB_MODE", "offline")  # no network unless the user asked for it
            self._wandb = wandb.init(dir=out, config=config or {}, resume="allow" if resume else None)

    def row(self, **fields: Any) -> None:
        """One row: written and flushed, and each number handed to the trackers under its name."""
        if self._file is None:
            return
        self._file.write(json.dumps(fields) + "\n")
        self._file.flush()
        step = fields["step"]
        numbers = {k: v for k, v in fields.items() if k != "step" and isinstance(v, (int, float))}
        if self._tensorboard is not None:
            for key, value in numbers.items():
                self._tensorboard.add_scalar(f"train/{key}" if key != "eval_loss" else "eval/loss", value, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
