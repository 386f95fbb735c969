"""Swapping the memory of two storages in place: how one rank borrows a stored shard
(runtime/flat_unit.py [Note: borrowed shards]).

The swap is `UntypedStorage._swap_data_ptr_`, a private torch method that older releases lack
(torch 2.11 has none). There one rank gathers each unit by a copy of its shard, as several ranks
do, and the engine says so once.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)


@functools.cache
def storage_swap_available() -> bool:
    """Whether this torch can swap two storages' memory; the first `False` is logged."""
    if hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        return True
    log.warning("torch %s cannot swap storages' memory (no UntypedStorage._swap_data_ptr_): with one rank and "
                "offloaded parameters, each unit is gathered by copying its shard, one copy more per unit per "
                "pass, held beside the DEVICE budget; a newer torch borrows the shard instead", torch.__version__)
    return False


def swap_storage_memory(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """`a` takes `b`'s memory and `b` takes `a`'s; every tensor on either sees the other's bytes."""
    a._swap_data_ptr_(b)  # type: ignore[attr-defined]  # private torch API, see storage_swap_available
