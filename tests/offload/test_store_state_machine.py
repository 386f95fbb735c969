"""A Hypothesis state machine checks the store against a plain dict, budgets after every step."""

import shutil
import tempfile

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from outcore.offload import IOConfig, Tier, TieredStore

KEYS = st.sampled_from([f"k{i}" for i in range(6)])
MEM_TIERS = st.sampled_from([Tier.HOST, Tier.DEVICE])
ALL_TIERS = st.sampled_from([Tier.NVME, Tier.HOST, Tier.DEVICE])
HOST_BUDGET, DEVICE_BUDGET = 40 << 10, 28 << 10  # room for a few keys of up to 12 KiB


class StoreVersusDict(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="outcore-sm-")
        self.store = TieredStore(self.dir, "cpu", DEVICE_BUDGET, HOST_BUDGET,
                                 IOConfig(block_size=4096, queue_depth=4, threads=2), wait_timeout=5)
        self.model: dict[str, torch.Tensor] = {}

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir)

    @rule(key=KEYS, n=st.integers(0, 3000), dtype=st.sampled_from([torch.float32, torch.int16, torch.uint8]),
          tier=ALL_TIERS)
    def put(self, key, n, dtype, tier):
        t = (torch.arange(n) * 7 + len(self.model)).to(dtype)
        self.store.put(key, t, tier)
        self.model[key] = t.clone()

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tier=MEM_TIERS)
    def fetch_and_check(self, data, tier):
        key = data.draw(st.sampled_from(sorted(self.model)))
        got = self.store.fetch(key, tier).result()
        assert got.dtype == self.model[key].dtype and torch.equal(got, self.model[key])
        self.store.release(key)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tier=MEM_TIERS)
    def fetch_and_modify(self, data, tier):
        key = data.draw(st.sampled_from(sorted(self.model)))
        got = self.store.fetch(key, tier).result()
        got.add_(1) if got.dtype != torch.bool else None
        self.model[key] = self.model[key] + 1
        self.store.release(key, dirty=True)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), to=st.sampled_from([Tier.HOST, Tier.NVME]), wait=st.booleans())
    def evict(self, data, to, wait):
        h = self.store.evict(data.draw(st.sampled_from(sorted(self.model))), to)
        if wait:
            h.wait()

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tier=MEM_TIERS)
    def prefetch(self, data, tier):
        keys = data.draw(st.lists(st.sampled_from(sorted(self.model)), max_size=4))
        self.store.prefetch(keys, tier)

    @rule()
    def flush(self):
        self.store.flush()

    @invariant()
    def budgets_hold_and_keys_match(self):
        s = self.store.stats()
        assert s["host"]["in_use"] + s["host"]["cached"] <= HOST_BUDGET
        assert s["device"]["in_use"] + s["device"]["cached"] <= DEVICE_BUDGET
        assert sorted(self.store.keys()) == sorted(self.model)


StoreVersusDict.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_store_versus_dict = pytest.mark.slow(StoreVersusDict.TestCase)
