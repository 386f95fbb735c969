"""The columns each TRL trainer reads from its datasets, checked as the trainer is built: a preference
dataset without `rejected` fails inside TRL's tokenization as a bare `KeyError: 'rejected'`; here it is
one line naming the dataset, the column and what its first row holds.

A dataset already in the trainer's tokenized form (TRL accepts `chosen_input_ids` and the like) is
taken as it is."""

from __future__ import annotations

from typing import Any

_PREFERENCE = (("chosen", "rejected"), ("chosen_input_ids", "rejected_input_ids"))
COLUMNS: dict[str, tuple[tuple[str, ...], ...]] = {  # a trainer class -> the column sets it takes, raw one first
    "DPOTrainer": _PREFERENCE,
    "ORPOTrainer": _PREFERENCE,
    "CPOTrainer": _PREFERENCE,
    "RewardTrainer": _PREFERENCE + (("input_ids_chosen", "input_ids_rejected"),),
    "KTOTrainer": (("prompt", "completion", "label"), ("prompt_input_ids", "completion_input_ids", "label")),
    "GRPOTrainer": (("prompt",),),
    "RLOOTrainer": (("prompt",),),
}


def _trainer_name(trainer: type) -> str | None:
    return next((cls.__name__ for cls in trainer.__mro__ if cls.__name__ in COLUMNS), None)


def first_row_columns(dataset: Any) -> list[str] | None:
    """The columns of a dataset's first row: a `datasets.Dataset` (or IterableDataset) by its
    column names, a sequence of dicts by its first; None where they cannot be known without
    reading the data through (an iterable of unknown form)."""
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list):
        return names
    try:
        first = dataset[0]
    except (TypeError, KeyError, IndexError, NotImplementedError):
        return None
    return list(first) if isinstance(first, dict) else None


def check_columns(trainer: type, datasets: dict[str, Any]) -> None:
    """ValueError naming the first column a trainer reads that a dataset of `datasets` (by its
    argument name: train_dataset, eval_dataset or eval_dataset[NAME]) lacks."""
    name = _trainer_name(trainer)
    if name is None:
        return
    for where, dataset in _each(datasets):
        columns = first_row_columns(dataset)
        if columns is None or any(set(option) <= set(columns) for option in COLUMNS[name]):
            continue
        raw = COLUMNS[name][0]
        missing = next(c for c in raw if c not in columns)
        held = ", ".join(columns) or "none"
        raise ValueError(f"{name}: {where} has no {missing!r} column (its first row holds {held}); {name} reads "
                         f"{', '.join(repr(c) for c in raw)} from each row. Rename or add the column before training.")


def _each(datasets: dict[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for where, dataset in datasets.items():
        if isinstance(dataset, dict):
            out += [(f"{where}[{key!r}]", d) for key, d in dataset.items()]
        elif dataset is not None:
            out.append((where, dataset))
    return out
