"""The one rule set (`StatePolicy`) and the memory plan built on it, without an engine; then the
engine's plan and `outcore estimate`'s agree for the same model."""

import dataclasses

import pytest
from models import TinyGPT

import outcore
from outcore.runtime.memory_plan import PAGE, UnitShape, plan_memory
from outcore.runtime.policy import StatePolicy
from outcore.tools.estimate import estimate

BASE = StatePolicy(world=1, stage=3, offload_params="nvme", offload_optimizer="nvme", dtype="fp32",
                   device_type="cpu", prefetch_depth=2, sub_group_size=1 << 22, clipping=True)


def policy(**kw) -> StatePolicy:
    return dataclasses.replace(BASE, **kw)


def shapes(shards: list[int], frozen: tuple[int, ...] = ()) -> list[UnitShape]:
    """One rank's units, the last the root; those at `frozen` indices frozen modules of their own."""
    return [UnitShape(s, s, i in frozen, i == len(shards) - 1, i) for i, s in enumerate(shards)]


@pytest.mark.parametrize(("shard", "group"), [(10_000, 4096), (4096, 4096), (5, 4096), (1 << 20, 1 << 22)])
def test_chunks_cover_the_shard_in_order_each_at_most_sub_group_size(shard, group):
    bounds = policy(sub_group_size=group).chunk_bounds(shard)
    assert bounds[0][0] == 0 and bounds[-1][1] == shard
    assert all(a < b <= a + group for a, b in bounds)
    assert all(prev[1] == nxt[0] for prev, nxt in zip(bounds, bounds[1:], strict=False))


@pytest.mark.parametrize("aliased", [False, True])
@pytest.mark.parametrize("shard", [0, 1, 4095, 4096, 4097, 3 * 4096, 10_000])
def test_chunk_sizes_count_the_chunks_chunk_bounds_lists(shard, aliased):
    p = policy(offload_params="none", offload_optimizer="none") if aliased else policy()
    p = dataclasses.replace(p, sub_group_size=4096)
    listed = [b - a for a, b in p.chunk_bounds(shard)]
    counted = [size for size, n in p.chunk_sizes(shard) for _ in range(n)]
    assert counted == listed


def test_the_plan_of_a_trillion_parameter_gpt_counts_chunks_without_listing_them(monkeypatch):
    """Four million chunks a unit: listing them took minutes and gigabytes; the plan is arithmetic."""
    monkeypatch.setattr(StatePolicy, "chunk_bounds", lambda self, shard: pytest.fail("chunks listed"))
    trillion = estimate([12 * 16384**2] * 300 + [1024 * 10**6], stage=3, offload_params="nvme",
                        offload_optimizer="nvme", sub_group_size=1024)
    blocks = 300 * 12 * 16384**2 + 1024 * 10**6
    assert trillion.optimizer_states == 12 * blocks  # [master|m|v] fp32, chunks a whole number of pages


def test_an_aliased_unit_is_one_chunk_whatever_sub_group_size():
    aliased = policy(offload_params="none", offload_optimizer="none", sub_group_size=1024)
    assert aliased.aliased and aliased.chunk_bounds(10_000) == [(0, 10_000)]


def test_which_units_stay_whole():
    assert policy(stage=1, offload_params="none").resident and policy(stage=2, offload_params="none").resident
    assert not policy().resident and policy().borrowing  # ZeRO-3, one rank: gathered by borrowing the shard
    assert policy(offload_params="none").aliased
    several = policy(world=2, offload_params="none")
    assert not several.resident and not several.borrowing and not several.aliased


def test_updates_overlap_backward_only_without_clipping_or_fp16():
    assert not policy().overlapped
    assert policy(clipping=False).overlapped and policy(clipping=False, dtype="bf16").overlapped
    assert not policy(clipping=False, dtype="fp16").overlapped
    assert policy(clipping=False).hands_over
    assert not policy(clipping=False, grad_accumulation=2).hands_over
    assert not policy(clipping=False, device_type="cuda").hands_over  # updates run in HOST, grads on the GPU
    assert policy(clipping=False, device_type="cuda", offload_optimizer="none").hands_over


def test_the_prefetch_window_has_two_levels_on_a_gpu_only():
    assert policy(prefetch_depth=4).device_window == 4
    assert policy(prefetch_depth=4, device_type="cuda").device_window == 2
    assert policy(prefetch_depth=1, device_type="cuda").device_window == 1


def test_the_fp32_parameter_shard_is_the_master_except_on_a_gpu_keeping_it_apart():
    assert policy().master_is_param and not policy(dtype="bf16").master_is_param
    assert not policy(device_type="cuda", offload_params="none", offload_optimizer="cpu").master_is_param
    assert policy(device_type="cuda").master_is_param


def test_a_host_budget_with_room_keeps_the_optimizer_states_of_the_units_the_forward_runs_first():
    shards = [8 * 1024, 4 * 1024, 4 * 1024, 1024]  # units 0-2, then the root
    plan = plan_memory(shapes(shards), policy())
    state = [8 * n for n in shards]  # fp32 [m|v], whole pages here
    assert plan.entry == (3, 0) and plan.unit_states == tuple(state)
    assert plan.entry_states == state[3] + state[0]
    base = plan.host.states + plan.host.runtime
    # The default budget holds the entry units' states: the root's, then the first unit's.
    _, host = plan.budgets(None, None, available=1 << 40)
    assert host == base + plan.entry_states and plan.kept_units(host) == {3, 0}
    assert plan.kept_units(base) == frozenset()
    assert plan.kept_units(base + state[3]) == {3}
    # Units in order after the entry ones, and only a prefix: unit 2 waits for unit 1 to fit.
    assert plan.kept_units(base + plan.entry_states + state[1]) == {3, 0, 1}
    assert plan.kept_units(base + plan.entry_states + state[1] - 1) == {3, 0}
    assert plan.keeps_optimizer_states(base + sum(state)) and not plan.keeps_optimizer_states(base + sum(state) - 1)
    kept = plan.placed(plan.kept_units(host))
    assert kept.host.states == plan.host.states + plan.entry_states
    assert kept.nvme.states == plan.nvme.states - plan.entry_states
    # With large modules outside the blocks (an embedding, an untied head), those are the entry
    # units beside the root: the embedding's gradient is final last, the head's first.
    outer = [UnitShape(s, s, False, i == 4, i, i in (0, 3)) for i, s in enumerate([8192, 4096, 4096, 8192, 1024])]
    assert plan_memory(outer, policy()).entry == (4, 0, 3)
    # States that rest in HOST anyway are not "kept": nothing moves.
    assert plan_memory(shapes(shards), policy(offload_optimizer="cpu")).kept_units(1 << 40) == frozenset()


def test_updates_read_ahead_further_only_where_the_host_budget_holds_the_plan():
    # [Note: optimizer read-ahead]: 8 chunks of 4 Mi elements, 32 MiB of [m|v] each.
    plan = plan_memory(shapes([(1 << 22) * 4, (1 << 22) * 4]), policy(clipping=False))
    chunk = 8 * (1 << 22) + PAGE
    assert (plan.read_ahead_least, plan.read_ahead_ample) == (2, 3)  # 96 MiB in whole chunks
    shallow = plan_memory(shapes([(1 << 22) * 4, (1 << 22) * 4]), policy(clipping=False, prefetch_depth=1))
    assert plan.host_min - shallow.host_min == chunk  # the least counts prefetch_depth chunks
    assert plan.host.runtime - shallow.host.runtime == 0  # with room, READ_AHEAD_BYTES either way
    base = plan.host.states + plan.host.runtime
    assert plan.read_ahead(base) == 3 and plan.read_ahead(base - 1) == 2
    _, host = plan.budgets(None, None, available=1 << 40)
    assert plan.read_ahead(host) == 3 and plan.read_ahead(plan.host_min) == 2
    # No more chunks ahead than there are; states in HOST are not streamed, so no read-ahead.
    tiny = plan_memory(shapes([4096, 4096, 1024]), policy(clipping=False))
    assert tiny.read_ahead_ample == 3
    assert plan_memory(shapes([4096, 1024]), policy(offload_optimizer="cpu")).read_ahead_ample == 2


def test_the_plan_counts_states_where_they_rest_by_hand():
    shards = [8192, 8192, 4096]  # elements (whole pages in fp32)
    plan = plan_memory(shapes(shards), policy())
    assert plan.nvme.states == 4 * sum(shards) + 8 * sum(shards)  # fp32 params + [m|v]
    assert plan.optimizer_states == 8 * sum(shards)
    assert plan.device.states == plan.host.states == 0
    # Clipping: every unit's fp32 gradient lives in the work tier (HOST) until the step.
    assert plan.host.runtime >= 4 * sum(shards)
    bf16 = plan_memory(shapes(shards), policy(dtype="bf16"))
    assert bf16.nvme.states == 2 * sum(shards) + 12 * sum(shards)  # bf16 params + [master|m|v]


def test_overlapped_updates_hold_about_one_units_gradient():
    shards = [8192] * 6
    clipped = plan_memory(shapes(shards), policy(clipping=True))
    overlapped = plan_memory(shapes(shards), policy(clipping=False))
    grads = 4 * sum(shards)
    assert clipped.host.runtime - overlapped.host.runtime >= grads - 2 * 4 * 8192 - PAGE * 8


def test_one_rank_that_cannot_borrow_counts_its_gathered_units_beside_the_stored_shards():
    """On a torch without the storage swap (runtime/storage_swap.py) one rank copies each unit in,
    as several ranks do, so the gathered units are planned as theirs are."""
    shards = [8192, 8192, 8192, 4096]
    borrowing = plan_memory(shapes(shards), policy())
    copying = plan_memory(shapes(shards), policy(storage_swap=False))
    assert policy().borrowing and not policy(storage_swap=False).borrowing
    assert borrowing.device.gathered == 0
    assert copying.device.gathered == plan_memory(shapes(shards), policy(world=2)).device.gathered > 0


def test_nothing_offloaded_keeps_every_state_on_the_device():
    shards = [8192, 4096]
    plan = plan_memory(shapes(shards), policy(offload_params="none", offload_optimizer="none"))
    assert plan.nvme.total == 0 and plan.host.states == 0
    assert plan.device.states == 4 * sum(shards) + 8 * sum(shards)
    assert plan.device_min == plan.device.states + plan.device.runtime


@pytest.mark.parametrize(("params", "optim", "clip"), [("nvme", "nvme", 1.0), ("cpu", "cpu", None),
                                                       ("none", "nvme", 1.0), ("none", "none", None)])
def test_the_engine_and_estimate_plan_the_same_bytes(tmp_path, params, optim, clip):
    model = TinyGPT(vocab=256, layers=3)
    with outcore.deferred_init():
        deferred = TinyGPT(vocab=256, layers=3)
    cfg = outcore.Config(stage=3, offload_params=params, offload_optimizer=optim, nvme_dir=str(tmp_path),
                         grad_clip=clip, sub_group_size=4096)
    engine = outcore.Engine(deferred, cfg, device="cpu")
    numels = [u.layout.numel for u in engine.units]
    ours = estimate(numels, world=1, dtype="fp32", stage=3, offload_params=params, offload_optimizer=optim,
                    sub_group_size=4096, grad_clip=clip, device="cpu")
    assert engine.memory_plan() == ours
    assert sum(numels) == sum(p.numel() for p in model.parameters())
    engine.close()
