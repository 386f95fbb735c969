"""OUT/run.json: the arguments `outcore train` ran with, so that `outcore train --out OUT --resume`
goes on with them alone.

Written as the run starts (rewritten by each resume, with what it changed). On `--resume` the
recorded arguments are the run's; a flag given again is checked against them:
- one that changes what is trained (`TRAINED`: the model, its adapters, the data and how it is read,
  the dtypes, the batch's shape, the seed, the config file) is refused where its value differs,
  naming it: the checkpoint and the rows drawn from the seed belong to the recorded run;
- any other (steps, budgets, placement, logging, evaluation, saving, the learning rate and its
  schedule) is applied, and said;
- `--model` at another path is applied and said too: a base moved elsewhere is the same base, and
  the checkpoint's record of the base's bytes (runtime/checkpoint/base_files.py) refuses other bytes
  as it loads.
"""

from __future__ import annotations

import json
import os
from typing import Any

RUN_FILE = "run.json"
TRAINED = ("preset", "model", "lora", "lora_alpha", "lora_targets", "lora_init", "dora", "quantize", "quantize_double",
           "data", "chat_template", "train_on_prompt", "no_packing", "eval_data", "eval_split", "dtype", "state_dtype",
           "batch", "seq", "accumulate", "seed", "config")
NOT_RECORDED = ("resume", "tag", "json", "command", "given")  # what one invocation asks, not the run
CHECKED_BY_BYTES = ("model",)  # a path the checkpoint verifies by content as it loads


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def record(out: str, args: dict[str, Any]) -> None:
    """Write `args` (a namespace's values) as OUT/run.json, atomically."""
    values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in args.items() if k not in NOT_RECORDED}
    path = os.path.join(out, RUN_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(values, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)


def recorded(out: str) -> dict[str, Any] | None:
    """OUT/run.json's arguments, or None where the run recorded none (one from before run.json)."""
    path = os.path.join(out, RUN_FILE)
    try:
        with open(path) as f:
            values = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume: {path} does not read as the run's arguments ({e}); give the run's flags again, "
                         "or remove the file.") from None
    if not isinstance(values, dict):
        raise ValueError(f"--resume: {path} does not hold the run's arguments; remove it and give the run's flags.")
    return values


def resumed(saved: dict[str, Any], now: dict[str, Any], given: set[str],
            world: int = 1) -> tuple[dict[str, Any], list[str]]:
    """The arguments a resume runs with: `saved`, with what `given` (the flags named this time) sets
    from `now`; and a line for each change. ValueError naming a flag that would change what is trained.
    `world`: the ranks this resume runs on; a `--batch` that keeps the rows a step (batch x ranks) the
    run's is a change of layout, not of what is trained."""
    merged = {**now, **{k: v for k, v in saved.items() if k in now}}
    said = []
    for dest in sorted(given - set(NOT_RECORDED) - {"out"}):
        before, after = saved.get(dest), now[dest]
        if _same(before, after):
            continue
        ranks = saved.get("world", 1)
        if dest == "batch" and isinstance(before, int) and before * ranks == after * world:
            merged[dest] = after
            said.append(f"--batch {after} on {world} rank(s) (the run had {before} on each of {ranks}: the same "
                        "rows a step)")
            continue
        if dest in TRAINED and dest not in CHECKED_BY_BYTES:
            raise ValueError(f"--resume: {flag(dest)} {_show(after)} differs from the run's {_show(before)} "
                             f"(OUT/{RUN_FILE}); it changes what is trained, so the checkpoint is not its start. "
                             "Leave it out to go on, or start a new run with another --out.")
        merged[dest] = after
        checked = "; the checkpoint checks that it holds the run's base" if dest in CHECKED_BY_BYTES else ""
        said.append(f"{flag(dest)} {_show(after)} (the run had {_show(before)}){checked}")
    return merged, said


def _same(a: Any, b: Any) -> bool:
    norm = (lambda v: list(v) if isinstance(v, tuple) else v)
    return bool(norm(a) == norm(b))


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)
