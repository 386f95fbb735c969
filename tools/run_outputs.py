"""What `outcore train` will write under `--out`, checked before step 1: a path in the way found
after hours of training loses the run at its first save.

- `OUT/checkpoints` must be a folder (or not exist yet), and every `step<N>` name in it, a tag
  this run may save under (`--save-every`, the last step, a stop by a signal at any step), an
  outcore checkpoint or absent: a save replaces only what outcore wrote.
- `OUT/tensorboard` and `OUT/wandb`, for the trackers `--report-to` names, must be folders or
  absent, not symbolic links: a tracker's files are never written through a link.
(`--json` is checked by the command itself, before any work; `log.jsonl` is opened without
following a link.)
"""

from __future__ import annotations

import os
import re

from outcore.runtime.checkpoint.guard import holds_only_a_save, is_checkpoint_folder

_STEP_TAG = re.compile(r"^step\d+$")
_STEP_ASIDE = re.compile(r"^\.step\d+\.old$")  # a tag's previous save, kept while it is saved again


def check_outputs(out: str, report_to: tuple[str, ...]) -> None:
    """ValueError naming the first output path of the run that is in the way (see the docstring)."""
    checkpoints = os.path.join(out, "checkpoints")
    if os.path.lexists(checkpoints) and not os.path.isdir(checkpoints):
        raise ValueError(f"{checkpoints!r} is a file, where the run saves its checkpoints; move it away, or give "
                         "another --out.")
    if os.path.isdir(checkpoints):
        for name in sorted(os.listdir(checkpoints)):
            path = os.path.join(checkpoints, name)
            if (_STEP_TAG.match(name) and not is_checkpoint_folder(path)) or (
                    _STEP_ASIDE.match(name) and not holds_only_a_save(path)):
                raise ValueError(f"{path!r} is not an outcore checkpoint (it has no meta.json), and the run may save "
                                 f"under that name; move it away, or give another --out.")
    for tracker in report_to:
        path = os.path.join(out, tracker)
        if os.path.islink(path):
            raise ValueError(f"{path!r} is a symbolic link; outcore writes --report-to {tracker}'s files into a "
                             "folder of the run's own, never through a link: remove the link.")
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{path!r} is a file, where --report-to {tracker} writes its folder; move it away.")
