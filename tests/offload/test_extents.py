from hypothesis import given, settings
from hypothesis import strategies as st

from outcore.offload.extents import ExtentAllocator
from outcore.offload.io_config import PAGE


def test_free_runs_coalesce_and_end_shrinks():
    a = ExtentAllocator()
    x, y, z = a.allocate(1), a.allocate(PAGE + 1), a.allocate(3 * PAGE)
    assert (x.offset, y.offset, z.offset) == (0, PAGE, 3 * PAGE)
    a.free(x)
    a.free(y)
    assert [(r.offset, r.length) for r in a.free_runs()] == [(0, 3 * PAGE)]
    assert a.allocate(2 * PAGE).offset == 0, "freed space is reused first"
    a.free(z)
    assert a.end == 2 * PAGE


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9 * PAGE)), max_size=60))
def test_extents_never_overlap_and_stay_aligned(ops):
    a = ExtentAllocator()
    live = []
    for alloc, size in ops:
        if alloc or not live:
            e = a.allocate(size)
            assert e.offset % PAGE == 0 and e.length % PAGE == 0 and e.length >= size
            live.append(e)
        else:
            a.free(live.pop(size % len(live)))
        spans = sorted((e.offset, e.offset + e.length) for e in live)
        assert all(s1[1] <= s2[0] for s1, s2 in zip(spans, spans[1:], strict=False))
        assert a.used == sum(e.length for e in live)
        assert all(end <= a.end for _, end in spans)
    for e in live:
        a.free(e)
    assert a.end == 0 and a.used == 0
