"""FlatUnit's two states and the only transitions between them, over a real store (one rank)."""

import dataclasses

import pytest
import torch
from torch import nn

from outcore.offload import Tier
from outcore.runtime.collectives import Group
from outcore.runtime.flat_unit import FlatUnit, Layout, UnitState
from outcore.runtime.policy import StatePolicy
from outcore.runtime.units import plan_units

POLICY = StatePolicy(world=1, stage=3, offload_params="nvme", offload_optimizer="nvme", dtype="fp32",
                     device_type="cpu", prefetch_depth=1, sub_group_size=1 << 22, clipping=True)


def make_unit(store, policy=POLICY):
    """The first block of a two-block stack as a FlatUnit whose shard is in the store."""
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
    plan = plan_units(model)[0]
    assert plan.name == "blocks.0"
    values = torch.cat([s.param.detach().reshape(-1) for s in plan.slots])
    layout = Layout.of(plan, 1, 4)
    unit = FlatUnit(plan, layout, policy, torch.device("cpu"), Group(), store)
    shard = torch.zeros(layout.padded)
    shard[: values.numel()] = values
    store.put(unit.param_key, shard, Tier.NVME)
    for slot in plan.slots:
        for module, name in slot.places:
            del module._parameters[name]
    return unit, values


def test_sharded_holds_no_memory_and_unshard_gathers_the_values(make_store):
    store = make_store()
    unit, values = make_unit(store)
    assert unit.state is UnitState.SHARDED and unit.flat.untyped_storage().nbytes() == 0
    unit.unshard()
    assert unit.state is UnitState.UNSHARDED and unit.borrowed  # one rank: the store's buffer, no copy
    assert torch.equal(unit.flat.detach()[: values.numel()], values)
    unit.bind_views()
    assert torch.equal(unit.plan.module.weight.detach().reshape(-1), values[:64])
    with pytest.raises(ValueError, match="in use"):  # pinned while gathered
        store.evict(unit.param_key, Tier.NVME)
    unit.reshard()
    assert unit.state is UnitState.SHARDED and unit.flat.untyped_storage().nbytes() == 0
    store.evict(unit.param_key, Tier.NVME).wait()  # released again


def test_each_transition_is_legal_only_from_its_own_start(make_store):
    unit, _ = make_unit(make_store())
    with pytest.raises(AssertionError, match="cannot reshard"):
        unit.reshard()  # already SHARDED
    with pytest.raises(AssertionError):
        unit.bind_views()  # nothing gathered to view
    unit.unshard()
    with pytest.raises(AssertionError, match="unshard\\(\\) of a gathered unit"):
        unit.unshard()
    with pytest.raises(AssertionError, match="refresh\\(\\) of a non-resident unit"):
        unit.refresh()
    unit.reshard()


def test_a_resident_unit_is_gathered_once_and_never_resharded(make_store):
    store = make_store()
    aliased = dataclasses.replace(POLICY, offload_params="none", offload_optimizer="none")
    unit, values = make_unit(store, aliased)
    store.evict(unit.param_key, Tier.NVME).wait()
    unit.alias_shard()  # the flat buffer is the stored shard itself
    assert unit.state is UnitState.UNSHARDED and unit.aliased and unit.resident
    with pytest.raises(AssertionError, match="already gathered"):
        unit.alias_shard()
    with pytest.raises(AssertionError, match="cannot reshard"):
        unit.reshard()
    unit.refresh()  # an aliased unit is updated in place: nothing to refill
    assert torch.equal(unit.flat.detach()[: values.numel()], values)
    assert torch.equal(unit.full_values()[: values.numel()], values)
