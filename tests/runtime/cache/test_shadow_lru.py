"""The sampled shadow LRU (runtime/cache/shadow_lru.py): exact LRU when it follows every key,
the sampling rate and capacity it picks, and the counts it reports per request."""
from __future__ import annotations

import os

from kvrt.runtime.cache.shadow_lru import MIN_ENTRIES, ShadowLRU


def _keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def test_small_cache_is_followed_exactly():
    s = ShadowLRU(4)
    assert s.rate == 1.0 and s.capacity == 4
    a, b = _keys(3), _keys(3)
    assert s.observe(a, 3, 0) == (3, 0, 0)
    assert s.observe(a, 2, 1) == (2, 1, 2)  # the usable first two, both held
    assert s.observe(b, 3, 0) == (3, 0, 0)  # b evicts a's deepest two: 4 kept, root side last
    assert len(s) == 4
    assert s.observe(a, 3, 0) == (3, 0, 1)  # a's root is more recent than b's deepest ones


def test_large_cache_is_sampled():
    s = ShadowLRU(100 * MIN_ENTRIES)
    assert s.capacity == MIN_ENTRIES and abs(s.rate - 0.01) < 1e-9
    seen = sum(s.observe(_keys(1000), 1000, 0)[0] for _ in range(20))
    assert 100 < seen < 300  # 1% of 20,000 keys
