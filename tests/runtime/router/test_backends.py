"""A backend's view of its cache as the policy reads it: tiers, and requests still in prefill."""
from __future__ import annotations

import zmq

from kvrt.runtime.cache.events import CPU, GPU, KVEventView, encode_batch, removed_event, stored_event
from kvrt.runtime.router.backends import PENDING_S, SLOW_TIER, Backend
from kvrt.runtime.router.policy import Candidate, Picker


def _backend(media: dict[bytes, set[str]]) -> tuple[Backend, zmq.Context]:
    ctx = zmq.Context()
    b = Backend("http://127.0.0.1:1", key_root=b"r" * 16, block_size=4)
    b.view = KVEventView("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", ctx)  # never read: its media are set here
    b.view.media = media
    return b, ctx


def test_held_blocks_count_by_tier_and_pending_ones_until_they_expire():
    keys = [bytes([i]) * 16 for i in range(5)]
    b, ctx = _backend({keys[0]: {GPU}, keys[1]: {CPU}, keys[3]: {GPU}})
    try:
        assert b.cached_prefix(keys, 100.0) == 1 + SLOW_TIER  # keys[2] is missing: keys[3] does not count
        b.sent(keys[:4], 100.0)
        assert b.cached_prefix(keys, 100.0 + PENDING_S / 2) == 1 + SLOW_TIER + 2  # keys[2], keys[3]: under way
        assert b.cached_prefix(keys, 100.0 + PENDING_S * 2) == 1 + SLOW_TIER
        assert b.cached_prefix([], 100.0) == 0
        b.view.close()
        b.view = None
        assert b.cached_prefix(keys, 100.0) == 0  # no events: no affinity
    finally:
        if b.view is not None:
            b.view.close()
        ctx.term()


def test_a_prefix_the_nodes_events_say_it_evicted_no_longer_draws_its_requests():
    """Node 0 held a conversation and then evicted all but its first block, which node 1 holds
    too (BlockRemoved events): the next turn no longer follows node 0 but the lesser churn."""
    keys = [bytes([i]) * 16 for i in range(8)]
    b0, ctx0 = _backend({})
    b1, ctx1 = _backend({})
    try:
        b0.view._apply(1, encode_batch([stored_event(keys[:6], None, 4, GPU)]))
        b1.view._apply(1, encode_batch([stored_event(keys[:1], None, 4, GPU)]))  # both hold the first block
        ca = Picker("cache-aware")
        ca.inflow = {0: 30.0, 1: 0.0}  # node 0 wrote more: only its cache draws the request there
        cands = lambda: [Candidate(i, 0, b.cached_prefix(keys, 100.0), len(keys)) for i, b in enumerate((b0, b1))]
        assert ca.pick(cands(), keys).index == 0
        b0.view._apply(2, encode_batch([removed_event(keys[1:6], GPU)]))  # evicted all but the first block
        assert b0.cached_prefix(keys, 100.0) == 1
        ca.inflow = {0: 30.0, 1: 0.0}
        assert ca.pick(cands(), keys).index == 1
    finally:
        for b, ctx in ((b0, ctx0), (b1, ctx1)):
            b.view.close()
            ctx.term()
