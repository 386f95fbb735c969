"""Before the first step, a batch whose activations cannot fit in the memory the run may have is
refused, naming the largest batch that fits; that batch then runs."""

import re

import pytest

from outcore.tools.activations import Shape, activation_rows, longest_seq, preflight
from outcore.tools.cli import main

TINY = Shape(layers=4, d_model=128, vocab=256)


def test_activation_rows_grow_with_the_batch_and_checkpointing_keeps_less():
    full = activation_rows(TINY, batch=2, seq=64, dtype="fp32", checkpointed=False)
    kept = activation_rows(TINY, batch=2, seq=64, dtype="fp32", checkpointed=True)
    assert sum(kept.values()) < sum(full.values())
    assert sum(activation_rows(TINY, batch=4, seq=64, dtype="fp32", checkpointed=False).values()) == 2 * sum(
        full.values())
    assert full["logits, their fp32 loss and its gradient"] == 2 * 64 * 3 * 256 * 4


def test_preflight_names_the_largest_batch_that_fits():
    per_row = sum(activation_rows(TINY, batch=1, seq=64, dtype="fp32", checkpointed=False).values())
    with pytest.raises(ValueError, match=r"give --batch 10 or less, or use --checkpoint-activations"):
        preflight(TINY, batch=11, seq=64, dtype="fp32", checkpointed=False, budgets=0, max_memory=10 * per_row + 1)
    preflight(TINY, batch=10, seq=64, dtype="fp32", checkpointed=False, budgets=0, max_memory=10 * per_row + 1)


def test_a_batch_far_too_large_exits_2_before_the_first_step_and_the_batch_it_names_runs(tmp_path, capsys):
    args = ["train", "--seq", "128", "--steps", "1", "--max-memory", "1G", "--dtype", "fp32", "--offload-params",
            "nvme", "--offload-optimizer", "nvme", "--host-budget", "64M", "--out", str(tmp_path / "run")]
    assert main([*args, "--batch", "100000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--accumulate" in err[0], err
    fits = int(re.search(r"give --batch (\d+) or less", err[0]).group(1))
    assert 1 <= fits < 100000 and not (tmp_path / "run").exists()
    assert main([*args, "--batch", str(fits), "--no-save"]) == 0


def test_the_rows_follow_the_loss_chunks_the_tiles_and_paged_inputs():
    """Issue 71, item 4: a run over loss chunks holds one chunk's logits, a tiled MLP one tile's wide
    values, paged block inputs the few read back; the longest context grows to match."""
    shape = Shape(layers=8, d_model=1024, vocab=128_256)
    whole = activation_rows(shape, batch=1, seq=32_768, dtype="bf16", checkpointed=True)
    how = {"loss_chunk": 1024, "tile": 4096, "inputs_paged": True}
    pieces = activation_rows(shape, batch=1, seq=32_768, dtype="bf16", checkpointed=True, **how)
    assert whole["logits, their fp32 loss and its gradient"] == 32_768 * 3 * 128_256 * 4
    assert pieces["logits of one loss chunk of 1,024 tokens, fp32, and their gradient"] == 1024 * 3 * 128_256 * 4
    paged = "block inputs paged (those read back at once, and the HOST room they page through)"
    assert pieces[paged] == 3 * 32_768 * 1024 * 2  # no room given
    assert pieces["one block recomputed in backward, its MLP over tiles of 4,096"] == \
        (32_768 * 9 + 4096 * 8) * 1024 * 2
    room = 4 << 30
    longest = longest_seq(shape, batch=1, dtype="bf16", checkpointed=True, room=room, **how)
    assert sum(activation_rows(shape, batch=1, seq=longest, dtype="bf16", checkpointed=True, **how).values()) <= room
    assert sum(activation_rows(shape, batch=1, seq=longest + 1, dtype="bf16", checkpointed=True, **how).values()) > room
    assert longest > 16 * longest_seq(shape, batch=1, dtype="bf16", checkpointed=True, room=room)


def test_paged_inputs_count_the_host_room_they_page_through():
    """The engine gives paged activations an eighth of the bound (at most 1 GiB) of HOST memory, and
    the inputs rest there while it has room: the rows count it whole, as a budget."""
    from outcore.tools.activations import paged_inputs_room

    shape = Shape(layers=8, d_model=1024, vocab=128_256)
    rows = activation_rows(shape, batch=1, seq=65_536, dtype="bf16", checkpointed=True, inputs_bound=6 << 30)
    one_block = 65_536 * 1024 * 2
    assert rows["block inputs paged (those read back at once, and the HOST room they page through)"] == \
        3 * one_block + (768 << 20)
    assert paged_inputs_room("nvme", 6 << 30) == paged_inputs_room("cpu", 6 << 30) == 768 << 20
    assert paged_inputs_room("nvme", 64 << 30) == 1 << 30
    assert paged_inputs_room("auto", 6 << 30) == paged_inputs_room(None, 6 << 30) == 0


def test_auto_pages_block_inputs_past_an_eighth_of_the_bound():
    from outcore.tools.activations import pages_inputs

    shape = Shape(layers=8, d_model=1024, vocab=128_256)  # 16 KiB of block inputs a token in bf16
    assert pages_inputs(shape, batch=1, seq=65_536, dtype="bf16", max_memory=6 << 30)  # 1 GiB > 768 MiB
    assert not pages_inputs(shape, batch=1, seq=32_768, dtype="bf16", max_memory=6 << 30)  # 512 MiB
    assert not pages_inputs(shape, batch=1, seq=1 << 20, dtype="bf16", max_memory=None)  # the engine decides


def test_the_chosen_pieces_follow_the_vocabulary_and_the_memory():
    from outcore.tools.activations import auto_loss_chunk, auto_tile

    llama3 = Shape(layers=8, d_model=1024, vocab=128_256)
    assert auto_loss_chunk(llama3) == 256 and auto_loss_chunk(Shape(2, 32, 64)) == 8192
    assert auto_tile(llama3, seq=4096, dtype="bf16", memory=6 << 30) is None  # a short context runs its MLPs whole
    tile = auto_tile(llama3, seq=32_768, dtype="bf16", memory=6 << 30)
    assert tile == 16_384 and tile * 8 * 1024 * 2 <= (6 << 30) / 16 < 2 * tile * 8 * 1024 * 2
