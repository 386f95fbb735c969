"""How `outcore train` holds a long sequence: the loss over chunks of tokens
(hf/chunked_head.py), each decoder MLP over tiles (hf/tiled_mlp.py), and under --max-memory the
block inputs paged to NVMe where they would take more than an eighth of it.

With `--model`, both are chosen unless given: the loss's chunk from the vocabulary (its fp32 logits
at most 256 MiB), and tiles only where one block's wide MLP values for the sequence would pass a
sixteenth of the run's memory (--max-memory, or what is available), so that a short context runs
its MLPs whole (tools/activations.py `auto_loss_chunk`, `auto_tile`). `--loss-chunk-tokens 0` and
`--tile-tokens 0` turn them off; `--offload-activations` sets where the inputs go. A chosen piece
that the model does not take (a head outside the known forms, a mixture of experts) is said once and
left off; a given one is refused.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from outcore.hf.chunked_head import install_chunked_loss
from outcore.hf.model_info import wrapped_model
from outcore.hf.tiled_mlp import install_tiled_mlp
from outcore.tools.activations import (
    Shape,
    auto_loss_chunk,
    auto_tile,
    available_memory,
    paged_inputs_room,
    pages_inputs,
)
from outcore.tools.train_job import Job
from outcore.tools.train_options import TrainOptions

log = logging.getLogger("outcore.train")


@dataclass(frozen=True)
class Pieces:
    """The sequence's pieces a run computes in."""

    loss_chunk: int | None  # tokens a loss chunk takes; None: the whole sequence at once
    tile: int | None  # tokens an MLP tile takes; None: untiled
    chosen: frozenset[str] = frozenset()  # which of the two were chosen here, not given

    def in_words(self) -> str:
        chunk = "whole logits" if self.loss_chunk is None else f"the loss over chunks of {self.loss_chunk:,} tokens"
        tile = "MLPs whole" if self.tile is None else f"MLPs over tiles of {self.tile:,} tokens"
        return f"{chunk}, {tile} (--loss-chunk-tokens, --tile-tokens to choose)"

    def as_rows(self) -> dict[str, int | None]:
        """What tools/activations.py's rows take."""
        return {"loss_chunk": self.loss_chunk, "tile": self.tile}


WHOLE = Pieces(None, None)  # a model computed as it is


def chosen_pieces(*, hf: bool, shape: Shape | None, loss_chunk_tokens: int | None, tile_tokens: int | None,
                  tokens: int, dtype: str, max_memory: int | None) -> Pieces:
    """The run's pieces: as given (0: off), else chosen for a Hugging Face model of known shape."""
    chosen: set[str] = set()
    chunk = loss_chunk_tokens or None
    tile = tile_tokens or None
    if hf and shape is not None:
        if loss_chunk_tokens is None:
            chunk = auto_loss_chunk(shape)
            chosen.add("loss_chunk")
        if tile_tokens is None:
            tile = auto_tile(shape, seq=tokens, dtype=dtype, memory=available_memory(max_memory))
            chosen.add("tile")
    return Pieces(chunk, tile, frozenset(chosen))


def sequence_plan(opts: TrainOptions, job: Job, checkpointing: bool, report: Callable[[str], None]
                  ) -> tuple[TrainOptions, Pieces, dict[str, Any]]:
    """What a step of `job` holds, said where chosen: the options (`--offload-activations` auto
    turned nvme where the block inputs would take more than an eighth of --max-memory), the pieces,
    and `activation_rows`' keywords for them (the HOST room paged inputs go through counted with
    them, where the host budget is derived)."""
    if (opts.offload_activations is None and checkpointing and job.shape is not None
            and pages_inputs(job.shape, batch=opts.batch, seq=job.seq, dtype=opts.dtype or "bf16",
                             max_memory=opts.max_memory)):
        opts = dataclasses.replace(opts, offload_activations="nvme")
        report("outcore train: activations: the block inputs kept for backward page to NVMe (more than an eighth "
               "of --max-memory; --offload-activations to choose)")
    pieces = chosen_pieces(hf=bool(opts.model), shape=job.shape, loss_chunk_tokens=opts.loss_chunk_tokens,
                           tile_tokens=opts.tile_tokens, tokens=job.seq, dtype=opts.dtype or "bf16",
                           max_memory=opts.max_memory)
    if pieces.chosen:
        report(f"outcore train: sequence: {pieces.in_words()}")
    paged = opts.offload_activations in ("cpu", "nvme")
    room = paged_inputs_room(opts.offload_activations, opts.max_memory) if paged and opts.host_budget is None else 0
    return opts, pieces, {**pieces.as_rows(), "inputs_paged": paged, "paging_room": room}


def install_pieces(model: nn.Module, pieces: Pieces) -> Pieces:
    """Install the pieces on a Hugging Face model; what was installed (a chosen piece the model
    does not take is said and dropped)."""
    chunk, tile = pieces.loss_chunk, pieces.tile
    if chunk is not None:
        try:
            install_chunked_loss(wrapped_model(model), chunk)
        except ValueError as e:
            if "loss_chunk" not in pieces.chosen:
                raise
            log.warning("the loss is computed whole: %s", e)
            chunk = None
    if tile is not None:
        try:
            install_tiled_mlp(model, tile)
        except ValueError as e:
            if "tile" not in pieces.chosen:
                raise
            log.warning("the MLPs run untiled: %s", e)
            tile = None
    return Pieces(chunk, tile, pieces.chosen)
