"""The cache-aware policy's spreading of new prefixes (the affinity and load rules are in
test_router.py)."""
from __future__ import annotations

import random

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


def _keys(blocks: list[int]) -> list[bytes]:
    return [bytes([b]) * 16 for b in blocks]  # distinct per block: enough for the sharing record's shape


def test_a_shared_prefix_is_copied_off_a_churning_node_but_a_conversations_own_history_is_followed():
    ca = Picker("cache-aware")
    tools = list(range(20))
    ca.sharing.see(_keys(tools + [100]))
    ca.sharing.see(_keys(tools + [101]))  # two loops under one tool list: it is shared
    ca.inflow = {0: 200.0, 1: 0.0}
    # node 0 holds the tool list (20 of 22 blocks) but writes far more than copying it to node 1 costs
    assert ca.pick([Candidate(0, 0, 20, 22), Candidate(1, 0, 0, 22)], _keys(tools + [102, 103])).index == 1
    # the next step of the loop now on node 0: node 0 holds its own history too, so it follows it
    ca.inflow = {0: 200.0, 1: 0.0}
    assert ca.pick([Candidate(0, 0, 21, 23), Candidate(1, 0, 0, 23)], _keys(tools + [100, 104, 105])).index == 0
    # copying is not worth it while node 0's churn is about as low as node 1's would be with the copy
    ca.inflow = {0: 10.0, 1: 0.0}
    assert ca.pick([Candidate(0, 0, 20, 22), Candidate(1, 0, 0, 22)], _keys(tools + [106, 107])).index == 0


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 5), st.integers(0, 4),
       st.lists(st.tuples(st.lists(st.floats(0, 64), min_size=5, max_size=5), st.integers(1, 64),
                          st.lists(st.integers(0, 3), min_size=1, max_size=8)), min_size=1, max_size=200))
def test_no_node_is_starved_whatever_the_nodes_events_say_they_hold(n, margin, reqs):
    """Requests that stay in flight, each node claiming any prefix of any request: the busiest
    node is never more than the load margin and one request ahead of the idlest, so every node
    keeps getting requests however the caches look."""
    ca = Picker("cache-aware", load_margin=margin)
    loads = [0] * n
    for held, size, shape in reqs:
        cands = [Candidate(i, loads[i], min(held[i], size), size) for i in range(n)]
        loads[ca.pick(cands, _keys(shape)).index] += 1
        assert max(loads) - min(loads) <= margin + 1


def test_the_head_of_a_history_its_node_partly_evicted_still_draws_the_next_turn():
    ca = Picker("cache-aware")
    ca.inflow = {0: 80.0, 1: 0.0}
    # node 0 evicted the tail of a conversation's 20 blocks and still holds 3: those are hits now
    assert ca.pick([Candidate(0, 0, 3, 20), Candidate(1, 0, 0, 20)], _keys(list(range(20)))).index == 0


@settings(max_examples=10, deadline=None)
@given(st.integers(2, 6), st.integers(0, 2**32))
def test_agent_loops_under_one_tool_list_spread_over_every_node(n, seed):
    """Loops that all start with one long tool list: the node that held it first does not keep
    them all (each node holds what it was sent, never evicting: the policy alone spreads them)."""
    rnd = random.Random(seed)
    ca = Picker("cache-aware")
    held: list[set[bytes]] = [set() for _ in range(n)]
    tools = list(range(24))
    loops = [tools + [1000 + i] for i in range(4 * n)]
    counts = [0] * n
    for step in range(40 * n):
        k = rnd.randrange(len(loops)) if step >= len(loops) else step  # every loop starts, then any steps
        loops[k] = loops[k] + [10_000 + step]
        keys = _keys_wide(loops[k])
        cands = []
        for i in range(n):
            m = 0
            while m < len(keys) and keys[m] in held[i]:
                m += 1
            cands.append(Candidate(i, 0, m, len(keys)))
        i = ca.pick(cands, keys).index
        held[i].update(keys)
        counts[i] += 1
    assert min(counts) > 0


def _keys_wide(blocks: list[int]) -> list[bytes]:
    """Chained keys of any ints (each key stands for the whole prefix up to its block)."""
    out, h = [], 0
    for b in blocks:
        h = hash((h, b))
        out.append(h.to_bytes(16, "big", signed=True))
    return out
