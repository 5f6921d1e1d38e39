"""The cache-aware policy's spreading of new prefixes (the affinity and load rules are in
test_router.py)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.runtime.router.policy import AFFINITY_SHARE, Candidate, Picker


def test_a_prefix_every_node_shares_does_not_bind_but_a_long_one_does():
    ca = Picker("cache-aware")
    ca.inflow = {0: 50.0, 1: 0.0}
    # node 0 holds 1 of 20 blocks (a system prompt): a new prefix, so it goes where fewer blocks were written
    assert ca.pick([Candidate(0, 0, 1, 20), Candidate(1, 0, 0, 20)]).index == 1
    # node 0 holds most of it: it follows the prefix though it wrote more
    assert ca.pick([Candidate(0, 0, 15, 20), Candidate(1, 0, 0, 20)]).index == 0
    assert ca.pick([Candidate(0, 0, AFFINITY_SHARE * 20 + 1, 20), Candidate(1, 0, 0, 20)]).index == 0


def test_written_blocks_are_what_the_chosen_node_lacked():
    ca = Picker("cache-aware")
    ca.pick([Candidate(0, 0, 0, 10), Candidate(1, 0, 0, 10)])
    first = max(ca.inflow, key=ca.inflow.get)
    assert ca.inflow[first] == 10
    ca.pick([Candidate(first, 0, 8, 10), Candidate(1 - first, 0, 0, 10)])  # follows its prefix, writes 2
    assert abs(ca.inflow[first] - (10 * 0.99 + 2)) < 1e-9


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 6), st.lists(st.integers(1, 64), min_size=1, max_size=300))
def test_new_prefixes_keep_the_nodes_writes_within_one_request_of_each_other(n, sizes):
    """Cold requests of any sizes: no node's written blocks run ahead of another's by more than
    the largest request, so none is starved or flooded."""
    ca = Picker("cache-aware")
    counts = [0] * n
    for s in sizes:
        counts[ca.pick([Candidate(i, 0, 0, s) for i in range(n)]).index] += 1
        written = [ca.inflow.get(i, 0.0) for i in range(n)]
        assert max(written) - min(written) <= max(sizes) + 1e-9
    if len(sizes) >= n:
        assert min(counts) >= 1
