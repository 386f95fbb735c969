"""Which engine checkpoint belongs to a Trainer's `checkpoint-N` folder, and which may be resumed.

A Trainer's `checkpoint-N/` holds its own files (trainer_state.json, the RNG states) beside
`outcore/`, the engine's sharded checkpoint. The two are written one after the other, and
nothing but the folder ties them together: an `outcore/` copied from another run, or left from an
earlier save of the same name, would resume the trainer at step N with another run's weights.
So each save records, in the engine checkpoint's client state and in `checkpoint-N/outcore_run.json`,
the run's id (drawn when the run starts, kept across its resumes) and the trainer's step; a resume
checks both against each other and against `trainer_state.json` before it reads a byte of weights.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from typing import Any

from outcore.runtime.checkpoint.folder import NoCheckpointError, find_checkpoint, read_meta

CHECKPOINT_SUBDIR = "outcore"  # checkpoint-N/outcore/: the engine's sharded checkpoint
RUN_FILE = "outcore_run.json"  # checkpoint-N/outcore_run.json: whose engine checkpoint belongs here
_NUMBERED = re.compile(r"^checkpoint-(\d+)$")


def new_run_id() -> str:
    return uuid.uuid4().hex


def identity(run_id: str, trainer_step: int) -> dict:
    """What a save records on both sides (the engine's client state and RUN_FILE)."""
    return {"run": run_id, "trainer_step": trainer_step}


def write_checkpoint_readme(model: Any, checkpoint: str) -> None:
    """A full fine-tune's `checkpoint-N`: its model's config.json, so that `from_pretrained` names
    the missing weights rather than an unknown model, and a README.md saying how to get them."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(checkpoint)
    name = os.path.basename(os.path.normpath(checkpoint))
    with open(os.path.join(checkpoint, "README.md"), "w") as f:
        f.write(f"# {name}\n\nThe model's weights and optimizer states are in `{CHECKPOINT_SUBDIR}/`, sharded as "
                "outcore's engine keeps them; the trainer resumes from this folder as it is. For a model directory "
                "that `from_pretrained` loads:\n\n"
                f"    outcore export {name}/{CHECKPOINT_SUBDIR} DIR\n\n"
                "(or `save_only_model=True` in the trainer's arguments, to export the model into each checkpoint "
                "instead).\n")


def write_identity(checkpoint: str, record: dict) -> None:
    """RUN_FILE into `checkpoint` (rank 0, after the engine's checkpoint is in place)."""
    with open(os.path.join(checkpoint, RUN_FILE), "w") as f:
        json.dump(record, f)


def check_resumable(checkpoint: str) -> str:
    """The run id of `checkpoint` (a `checkpoint-N` folder), once its engine checkpoint is found
    whole and found to belong to it; else one ValueError that names what differs, and for an
    incomplete folder the newest complete one before it."""
    engine_dir = os.path.join(checkpoint, CHECKPOINT_SUBDIR)
    if not os.path.isdir(engine_dir):
        def has(*names: str) -> bool:
            return any(os.path.isfile(os.path.join(checkpoint, name)) for name in names)

        if has("optimizer.pt", "optimizer.bin", "scheduler.pt"):  # what transformers.Trainer itself saves
            why = ("is a plain Trainer's checkpoint (its optimizer.pt holds torch's optimizer, not outcore's sharded "
                   "states): outcore cannot continue it. Start a new run from its weights (model= that folder), or "
                   "resume it with the plain trainer")
        elif has("config.json", "adapter_config.json"):
            why = ("was saved with save_only_model=True: it holds the model, not the optimizer states a resume "
                   "needs; start a new run from it (model= that folder)")
        else:
            why = f"holds no outcore checkpoint ({CHECKPOINT_SUBDIR}/)"
        raise ValueError(f"resume_from_checkpoint={checkpoint!r} {why}{_previous_hint(checkpoint)}.")
    try:
        meta = read_meta(find_checkpoint(engine_dir))
    except (NoCheckpointError, OSError) as e:
        raise ValueError(f"resume_from_checkpoint={checkpoint!r}: its engine checkpoint is incomplete ({e})"
                         f"{_previous_hint(checkpoint)}.") from e
    engine_side = (meta.get("client_state") or {}).get("trainer") or {}
    trainer_step = _trainer_step(checkpoint)
    if not engine_side and not os.path.exists(os.path.join(checkpoint, RUN_FILE)):
        engine_side = {"trainer_step": meta.get("step"), "run": None}  # saved before runs were recorded
        folder_side: dict = {"run": None}
    else:
        try:
            with open(os.path.join(checkpoint, RUN_FILE)) as f:
                folder_side = json.load(f)
        except (OSError, ValueError):
            folder_side = {}
    if engine_side.get("trainer_step") != trainer_step:
        raise ValueError(f"resume_from_checkpoint={checkpoint!r}: its trainer state is at step {trainer_step}, and "
                         f"the engine checkpoint in {CHECKPOINT_SUBDIR}/ was saved at trainer step "
                         f"{engine_side.get('trainer_step', 'unknown')} (engine step {meta.get('step')}): they are "
                         "not one save. Resume from a checkpoint-N folder as the trainer wrote it.")
    if not isinstance(folder_side, dict) or "run" not in folder_side or folder_side["run"] != engine_side.get("run"):
        raise ValueError(f"resume_from_checkpoint={checkpoint!r}: the engine checkpoint in {CHECKPOINT_SUBDIR}/ was "
                         f"written by another run than the folder's trainer state (run "
                         f"{engine_side.get('run', 'unknown')} against {folder_side.get('run', 'none recorded')}), "
                         f"both at step {trainer_step}. Resume from a checkpoint-N folder as the trainer wrote it.")
    return engine_side["run"] or new_run_id()


def _trainer_step(checkpoint: str) -> int | None:
    try:
        with open(os.path.join(checkpoint, "trainer_state.json")) as f:
            return int(json.load(f)["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _previous_hint(checkpoint: str) -> str:
    """"; the newest complete one before it is ...", or "" where there is none."""
    parent, name = os.path.split(os.path.normpath(checkpoint))
    mine = _NUMBERED.match(name)
    try:
        names = os.listdir(parent)
    except OSError:
        return ""
    earlier = sorted((int(m.group(1)), n) for n in names if (m := _NUMBERED.match(n))
                     and (mine is None or int(m.group(1)) < int(mine.group(1))))
    for _, n in reversed(earlier):
        try:
            find_checkpoint(os.path.join(parent, n, CHECKPOINT_SUBDIR))
        except (ValueError, OSError):
            continue
        return f"; the newest complete checkpoint before it is {os.path.join(parent, n)!r}: resume from that"
    return ""
