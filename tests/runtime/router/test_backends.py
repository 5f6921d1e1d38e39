"""A backend's view of its cache as the policy reads it: tiers, and requests still in prefill."""
from __future__ import annotations

import zmq

from kvrt.runtime.cache.events import CPU, GPU, KVEventView
from kvrt.runtime.router.backends import PENDING_S, SLOW_TIER, Backend


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
