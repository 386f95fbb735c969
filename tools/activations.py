"""The memory a training step's activations take, before the first step: what `outcore train`
checks a batch against (`preflight`), and the rows `outcore estimate --batch B --seq S` prints.

The model is a decoder's, by its shape (layers, width, vocabulary) and the compute dtype:
- each block keeps about 17 values of its width per token for backward (its input, the attention's
  q, k, v and output, the MLP's input, its wide hidden layer and activation, the norms' outputs:
  Korthikanti et al.'s 34 bytes per token and width at 2 bytes a value, with attention scores not
  kept, as flash and SDPA attention keep none);
- with activation checkpointing a block keeps only its input, and the one block being recomputed
  in backward holds its 17 again;
- the head's logits, their fp32 copy for the loss and its gradient: 3 values of the vocabulary per
  token (the loss's own log-softmax included), the largest part for a short context; with the loss
  over chunks (hf/chunked_head.py), those of one chunk;
- with the MLP tiled over the sequence (hf/tiled_mlp.py), the recomputed block's MLP holds a tile's
  wide values (`MLP_VALUES` of the 17), and with the block inputs paged (runtime/saved_activations.py)
  the memory holds the few being read back, and the HOST room the engine gives paged activations
  (`host_share`: the inputs page through it and rest there while it has room; counted whole, as a
  budget is).
The figure errs high on purpose: it decides whether a run starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psutil

from outcore.hf.chunked_head import chosen_chunk
from outcore.hf.tiled_mlp import MLP_VALUES, chosen_tile, tile_room
from outcore.runtime.activation_paging import host_share
from outcore.runtime.policy import DTYPES

BLOCK_VALUES = 17  # values of the width a block keeps per token for backward
HEAD_VALUES = 3  # values of the vocabulary the head and the loss keep per token, in fp32
INPUTS_SHARE = 1 / 8  # of --max-memory: block inputs beyond it page to NVMe under `auto`
PAGED_IN_MEMORY = 3  # block inputs a paged step holds at once: the one recomputed and two read ahead


@dataclass(frozen=True)
class Shape:
    layers: int
    d_model: int
    vocab: int


def activation_rows(shape: Shape, *, batch: int, seq: int, dtype: str, checkpointed: bool,
                    loss_chunk: int | None = None, tile: int | None = None, inputs_paged: bool = False,
                    tile_memory: int | None = None, inputs_bound: int | None = None,
                    paging_room: int = 0) -> dict[str, int]:
    """Bytes by part, per rank, for one micro-batch of `batch` x `seq` tokens; `loss_chunk`,
    `tile`: tokens of the loss's chunks and of the MLP's tiles (None: whole); `inputs_paged`: the
    checkpointed blocks' inputs page out of memory, through `paging_room` bytes of HOST memory the
    engine gives them (`paged_inputs_room`). As `outcore train` chooses them: `tile_memory`, tiles
    chosen for that much memory (`auto_tile`); `inputs_bound`, inputs paged as `auto` pages them
    under that --max-memory (`pages_inputs`), through the room it gives them."""
    if tile is None and tile_memory is not None:
        tile = auto_tile(shape, seq=seq, dtype=dtype, memory=tile_memory)
    if inputs_bound is not None and checkpointed and not inputs_paged:
        inputs_paged = pages_inputs(shape, batch=batch, seq=seq, dtype=dtype, max_memory=inputs_bound)
        paging_room = paged_inputs_room("nvme", inputs_bound) if inputs_paged else 0
    tokens, elem = batch * seq, DTYPES[dtype][1]
    mlp_tokens = tokens if tile is None else batch * min(seq, tile)
    block = (tokens * (BLOCK_VALUES - MLP_VALUES) + mlp_tokens * MLP_VALUES) * shape.d_model * elem
    if not checkpointed:
        rows = {"every block's activations": block * shape.layers}
    elif inputs_paged:
        one_block = tokens * shape.d_model * elem
        rows = {"block inputs paged (those read back at once, and the HOST room they page through)":
                one_block * min(shape.layers, PAGED_IN_MEMORY) + paging_room}
    else:
        rows = {"block inputs kept for backward": tokens * shape.layers * shape.d_model * elem}
    if checkpointed:
        rows["one block recomputed in backward" + ("" if tile is None else f", its MLP over tiles of {tile:,}")] = block
    if loss_chunk is None:
        rows["logits, their fp32 loss and its gradient"] = tokens * HEAD_VALUES * shape.vocab * 4
    else:
        rows[f"logits of one loss chunk of {loss_chunk:,} tokens, fp32, and their gradient"] = \
            min(tokens, loss_chunk) * HEAD_VALUES * shape.vocab * 4
    return rows


def auto_loss_chunk(shape: Shape) -> int:
    """The loss's chunk where not given, as hf/chunked_head.py chooses it from the vocabulary."""
    return chosen_chunk(shape.vocab)


def chosen_by_train(shape: Shape, max_memory: int | None, memory: int | None = None) -> dict[str, Any]:
    """`activation_rows`' keywords for a step as `outcore train --model` computes it by default: the
    loss over chunks, tiles for `memory` (default: what the run may have), the block inputs paged as
    `auto` pages them."""
    return {"loss_chunk": auto_loss_chunk(shape),
            "tile_memory": available_memory(max_memory) if memory is None else memory, "inputs_bound": max_memory}


def auto_tile(shape: Shape, *, seq: int, dtype: str, memory: int) -> int | None:
    """The MLP's tile where not given: None (untiled) where one block's wide MLP values for `seq`
    tokens fit in hf/tiled_mlp.py's share of `memory` (so a short context pays nothing for tiling),
    else the tile it chooses."""
    if seq <= tile_room(shape.d_model, memory, DTYPES[dtype][1]):
        return None
    return chosen_tile(shape.d_model, memory, DTYPES[dtype][1])


def pages_inputs(shape: Shape, *, batch: int, seq: int, dtype: str, max_memory: int | None) -> bool:
    """Whether `--offload-activations auto` pages a checkpointed run's block inputs to NVMe: under
    --max-memory, where they would take more than `INPUTS_SHARE` of it (without a bound, the
    engine decides as a pass runs: runtime/activation_paging.py)."""
    if max_memory is None:
        return False
    return batch * seq * shape.layers * shape.d_model * DTYPES[dtype][1] > max_memory * INPUTS_SHARE


def paged_inputs_room(mode: str | None, max_memory: int | None) -> int:
    """HOST bytes the engine gives activations that page (`mode` "cpu" or "nvme"; else 0), as
    runtime/activation_paging.py sizes them: from --max-memory where given, else from the memory
    available. `outcore train` gives the engine this room itself under --max-memory, so that it is
    counted there."""
    return host_share(mode or "none", available_memory(max_memory))


def longest_seq(shape: Shape, *, batch: int, dtype: str, checkpointed: bool, room: int, **how: Any) -> int:
    """The longest context whose activations (`activation_rows` with `how`, growing with the tokens)
    fit in `room` bytes at `batch` rows; 0 where not even one token does."""
    def fits(seq: int) -> bool:
        return sum(activation_rows(shape, batch=batch, seq=seq, dtype=dtype, checkpointed=checkpointed,
                                   **how).values()) <= room

    low, high = 0, 1
    while fits(high) and high < 1 << 40:
        low, high = high, high * 2
    while high - low > 1:  # fits(low), not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def available_memory(max_memory: int | None = None) -> int:
    """Bytes this run may take: `max_memory` where given, else what the machine has available now,
    within the cgroup's limit where there is one."""
    if max_memory is not None:
        return max_memory
    free = psutil.virtual_memory().available
    limit = _cgroup_room()
    return min(free, limit) if limit is not None else free


def _cgroup_room() -> int | None:
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def preflight(shape: Shape, *, batch: int, seq: int, dtype: str, checkpointed: bool, budgets: int,
              max_memory: int | None = None, **how: Any) -> dict[str, int]:
    """The step's activation rows (`activation_rows` with `how`), or a ValueError where they and the
    store's budgets do not fit in the memory the run may have, naming the largest batch that does and
    what else would."""
    rows = activation_rows(shape, batch=batch, seq=seq, dtype=dtype, checkpointed=checkpointed, **how)
    room = available_memory(max_memory) - budgets
    need = sum(rows.values())
    if need <= room:
        return rows
    per_row = sum(activation_rows(shape, batch=1, seq=seq, dtype=dtype, checkpointed=checkpointed, **how).values())
    fits = room // per_row
    where = f"--max-memory {_gib(max_memory)}" if max_memory is not None else "available memory"
    longest = longest_seq(shape, batch=1, dtype=dtype, checkpointed=checkpointed, room=room, **how)
    advice = (f"give --batch {fits} or less" if fits >= 1 else
              f"no --batch fits at --seq {seq}: give --seq {longest} or less" if longest >= 1 else
              f"no --batch fits at --seq {seq}, nor at any --seq")
    others = [] if checkpointed else ["--checkpoint-activations (each block keeps only its input)"]
    others.append(f"--accumulate K (K micro-batches of --batch {max(fits, 1)} a step)" if fits >= 1 else
                  "--offload-params/--offload-optimizer nvme to free the budgets' memory")
    raise ValueError(f"--batch {batch} x --seq {seq} needs about {_gib(need)} of activations, and this process "
                     f"with the store's budgets {_gib(budgets)}, over the {_gib(room + budgets)} of {where}; {advice}, "
                     "or use "
                     + " or ".join(others) + ".")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
