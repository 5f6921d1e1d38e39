"""What the router learns of which prefixes prompts share (runtime/router/sharing.py)."""
from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.runtime.router.sharing import Sharing


def chained(blocks: list[int]) -> list[bytes]:
    """Keys as a node chains them: each one stands for the whole prefix up to its block."""
    out, h = [], b"root"
    for b in blocks:
        h = hashlib.blake2b(h + b.to_bytes(4, "big"), digest_size=16).digest()
        out.append(h)
    return out


def test_prompts_that_part_share_the_prefix_before_the_parting_and_a_continued_one_shares_nothing():
    s = Sharing()
    system, a, b = [1, 2], [10, 11, 12], [20, 21]
    assert s.see(chained(system + a)) == 0
    assert s.see(chained(system + b)) == 2  # it parts from a after the system prompt
    assert s.see(chained(system + a + [13])) == 2  # the system prompt is shared, a's own history is not
    assert s.see(chained(system + a + [13, 14])) == 2  # the next turn of a continues it
    assert s.see(chained([7, 8, 9])) == 0
    assert s.see([]) == 0


def test_memory_is_bounded_and_a_forgotten_key_is_unshared_again():
    s = Sharing(capacity=8)
    s.see(chained([1, 2, 3]))
    s.see(chained([1, 2, 4]))
    assert s.see(chained([1, 2, 5])) == 2
    for i in range(40):  # other prompts push the first ones out (two generations of 8 keys)
        s.see(chained([100 + i]))
    assert len(s._new) + len(s._old) <= 2 * (8 + 1)
    assert s.see(chained([1, 2, 6])) == 0


def _oracle(seen: list[list[int]], p: list[int]) -> int:
    """The deepest i such that prompts seen (or p itself) follow p[:i] with two different blocks."""
    depth = 0
    for i in range(1, len(p)):
        nexts = {q[i] for q in seen if len(q) > i and q[:i] == p[:i]}
        if len(nexts) >= 2 or (len(nexts) == 1 and p[i] not in nexts):
            depth = i
    return depth


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=12))
def test_shared_depth_is_where_some_prompt_seen_parted_from_this_one(prompts):
    s = Sharing()
    for i, p in enumerate(prompts):
        assert s.see(chained(p)) == _oracle(prompts[:i], p)
