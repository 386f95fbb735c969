"""OUT/run.json: the arguments `outcore train` ran with, so that `outcore train --out OUT --resume`
goes on with them alone.

Written as the run starts (rewritten by each resume, with what it changed). The run is the OUT the
command names: OUT itself is never recorded, and the paths the run reads are recorded absolute, or
relative to OUT where they lie inside it, so that a run directory copied or moved elsewhere resumes
where it now is, on the files it read. Each data file's size and CRC-32C are recorded too
(tools/data_fingerprint.py): a resume on data whose bytes changed is refused, naming the file, unless
`--data-changed-ok` says to go on.

On `--resume` the recorded values are checked as the flags are (their types, ranges and choices; an
unknown key is refused), and a flag given again is checked against them:
- one that changes what is trained (`TRAINED`: the model, its adapters, the data and how it is read,
  the dtypes, the batch's shape, the seed, the config file) is refused where its value differs,
  naming it: the checkpoint and the rows drawn from the seed belong to the recorded run; so is a
  resume on another number of ranks that would change the rows a step;
- any other (steps, budgets, placement, logging, evaluation, saving, the learning rate and its
  schedule) is applied, and said;
- `--model` at another path is applied and said too: a base moved elsewhere is the same base, and
  the checkpoint's record of the base's bytes (runtime/checkpoint/base_files.py) refuses other bytes
  as it loads.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from outcore.hf.data_mix import data_file
from outcore.tools.data_fingerprint import changed, fingerprints

RUN_FILE = "run.json"
FORMAT = 2  # paths absolute or relative to OUT, data fingerprints; a record without it: paths as typed
TRAINED = ("preset", "model", "lora", "lora_alpha", "lora_targets", "lora_init", "dora", "quantize", "quantize_double",
           "data", "chat_template", "train_on_prompt", "no_packing", "eval_data", "eval_split", "dtype", "state_dtype",
           "batch", "seq", "accumulate", "seed", "config")
NOT_RECORDED = ("resume", "tag", "json", "command", "given", "out", "data_changed_ok")  # this invocation's
CHECKED_BY_BYTES = ("model",)  # a path the checkpoint verifies by content as it loads
PATHS = ("model", "eval_data", "chat_template", "config", "nvme_dir")  # one path each; `data`: a list of FILE[:W]
_KEPT = {"world": int, "format": int, "data_bytes": dict}  # what the record holds beside the flags


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def record(out: str, args: dict[str, Any]) -> None:
    """Write `args` (a namespace's values, `world` among them) as OUT/run.json, atomically, its paths
    as they read from anywhere and its data files' fingerprints."""
    values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in args.items() if k not in NOT_RECORDED}
    values = _portable_paths(values, out)
    values["format"] = FORMAT
    values["data_bytes"] = {_portable(path, out): bytes_held
                            for path, bytes_held in fingerprints(_data_paths(_local_paths(values, out))).items()}
    path = os.path.join(out, RUN_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(values, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)


def recorded(out: str, actions: dict[str, argparse.Action]) -> dict[str, Any] | None:
    """OUT/run.json's arguments, checked as `actions` (the train command's flags) check them and with
    their paths readable from here; None where the run recorded none (one from before run.json)."""
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
    checked = {key: _checked(path, key, value, actions) for key, value in values.items()}
    return _local_paths(checked, out) if checked.get("format") == FORMAT else checked


def resumed(saved: dict[str, Any], now: dict[str, Any], given: set[str],
            world: int = 1) -> tuple[dict[str, Any], list[str]]:
    """The arguments a resume runs with: `saved` (as `recorded` gives it), with what `given` (the flags
    named this time) sets from `now`; and a line for each change. ValueError naming a flag that would
    change what is trained, or a data file whose bytes changed. `world`: the ranks this resume runs
    on; a `--batch` that keeps the rows a step (batch x ranks) the run's is a change of layout, not of
    what is trained."""
    merged = {**now, **{k: v for k, v in saved.items() if k in now and k not in NOT_RECORDED}}
    said = []
    here = _local_paths(_portable_paths(now, now["out"]), now["out"])  # the given paths as the record holds them
    for dest in sorted(given - set(NOT_RECORDED)):
        before, after = saved.get(dest), here[dest]
        if _same(before, after) or _same(before, now[dest]):  # a record from before FORMAT: paths as typed
            continue
        ranks = saved.get("world", 1)
        if dest == "batch" and isinstance(before, int) and before * ranks == after * world:
            merged[dest] = after
            said.append(f"--batch {after} on {world} rank(s) (the run had {before} on each of {ranks}: the same "
                        "rows a step)")
            continue
        if dest in TRAINED and dest not in CHECKED_BY_BYTES:
            raise ValueError(f"--resume: {flag(dest)} {_show(now[dest])} differs from the run's {_show(before)} "
                             f"(OUT/{RUN_FILE}); it changes what is trained, so the checkpoint is not its start. "
                             "Leave it out to go on, or start a new run with another --out.")
        merged[dest] = after
        checked = "; the checkpoint checks that it holds the run's base" if dest in CHECKED_BY_BYTES else ""
        said.append(f"{flag(dest)} {_show(now[dest])} (the run had {_show(before)}){checked}")
    said += _ranks_checked(saved, merged, given, world)
    said += _data_checked(saved, merged, bool(now.get("data_changed_ok")))
    return merged, said


def _ranks_checked(saved: dict[str, Any], merged: dict[str, Any], given: set[str], world: int) -> list[str]:
    """A resume on another number of ranks keeps the run's rows a step, or is refused with the --batch that would."""
    ranks = saved.get("world", 1)
    if ranks == world or "batch" in given or not isinstance(saved.get("batch"), int):
        return []
    rows = saved["batch"] * ranks
    keep = (f"give --batch {rows // world} to keep them" if rows % world == 0 else
            f"{rows} rows do not divide among {world} ranks: resume on {ranks}")
    raise ValueError(f"--resume: the run took {rows} rows a step ({ranks} rank(s) of --batch {saved['batch']}); on "
                     f"{world} rank(s) --batch {saved['batch']} takes {saved['batch'] * world}, another training "
                     f"run; {keep}.")


def _data_checked(saved: dict[str, Any], merged: dict[str, Any], changed_ok: bool) -> list[str]:
    """A data file whose bytes differ from the record's is refused, or said with --data-changed-ok."""
    out = merged["out"]
    held = {path: (saved.get("data_bytes") or {}).get(_portable(path, out)) for path in _data_paths(merged)}
    lines = changed({path: fp for path, fp in held.items() if fp is not None}, list(held))
    if not lines:
        return []
    if not changed_ok:
        raise ValueError(f"--resume: {lines[0]}; the checkpoint was trained on what it held. Restore the file, or "
                         "give --data-changed-ok to go on with what it holds now.")
    return [f"--data-changed-ok: {line}" for line in lines]


def _data_paths(values: dict[str, Any]) -> list[str]:
    files = [data_file(spec).path for spec in values.get("data") or ()]
    return files + ([values["eval_data"]] if values.get("eval_data") else [])


def _portable_paths(values: dict[str, Any], out: str) -> dict[str, Any]:
    """`values` with each path absolute, or relative to `out` where it lies inside it."""
    values = dict(values)
    for key in PATHS:
        if isinstance(values.get(key), str):
            values[key] = _portable(values[key], out)
    if isinstance(values.get("data"), (list, tuple)):
        values["data"] = [_portable_spec(spec, out) if isinstance(spec, str) else spec for spec in values["data"]]
    return values


def _portable(path: str, out: str) -> str:
    """`path` absolute, or relative to `out` where it lies inside it."""
    where = os.path.abspath(path)
    inside = os.path.relpath(where, os.path.abspath(out))
    return where if inside == os.pardir or inside.startswith(os.pardir + os.sep) else inside


def _portable_spec(spec: str, out: str) -> str:
    """A `--data FILE[:W]` with its file `_portable`, its weight kept."""
    path = data_file(spec).path if spec else spec
    return _portable(path, out) + spec[len(path):]


def _local_paths(values: dict[str, Any], out: str) -> dict[str, Any]:
    """`values` (paths as `_portable_paths` keeps them) with the paths relative to OUT joined to it."""
    values = dict(values)
    for key in PATHS:
        if isinstance(values.get(key), str) and not os.path.isabs(values[key]):
            values[key] = os.path.join(out, values[key])
    if isinstance(values.get("data"), list):
        values["data"] = [spec if os.path.isabs(spec) else os.path.join(out, spec) for spec in values["data"]]
    return values


def _checked(path: str, key: str, value: Any, actions: dict[str, argparse.Action]) -> Any:
    """`value` as the flag `key` reads it, or ValueError naming the key in `path` and what it takes."""
    def wrong(what: str) -> ValueError:
        return ValueError(f"--resume: {path}: {key!r} is {_quoted(value)}, {what}; mend or remove the file, or give "
                          "the run's flags.")

    if key in _KEPT:
        if not isinstance(value, _KEPT[key]) or isinstance(value, bool):
            raise wrong(f"not a {_KEPT[key].__name__}")
        return value
    action = actions.get(key)
    if action is None or key in NOT_RECORDED:
        raise wrong("not a flag of outcore train")
    if action.nargs == 0:  # a switch: --dora, --checkpoint-activations/--no-checkpoint-activations
        if not isinstance(value, bool) and not (value is None and action.default is None):
            raise wrong(f"not true or false (the switch {flag(key)})")
        return value
    if value is None or value == [] and not action.default:  # unset, or a list flag given no value
        return value
    items = value if isinstance(action, argparse._AppendAction) else [value]
    if not isinstance(items, list):
        raise wrong(f"not a list (each {flag(key)} given)")
    parsed = []
    for item in items:
        text = ",".join(map(str, item)) if isinstance(item, list) else item
        if not isinstance(text, (str, int, float)) or isinstance(text, bool):
            raise wrong(f"not a value of {flag(key)}")
        try:
            typed = action.type(str(text)) if callable(action.type) else str(text)
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise wrong(f"not what {flag(key)} takes ({e})") from None
        if action.choices is not None and typed not in action.choices:
            raise wrong(f"not one of {', '.join(map(str, action.choices))}")
        parsed.append(typed)
    return parsed if isinstance(action, argparse._AppendAction) else parsed[0]


def _quoted(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _same(a: Any, b: Any) -> bool:
    norm = (lambda v: list(v) if isinstance(v, tuple) else v)
    return bool(norm(a) == norm(b))


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)
