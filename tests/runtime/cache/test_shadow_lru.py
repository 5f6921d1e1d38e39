"""The sampled shadow LRU (runtime/cache/shadow_lru.py): exact LRU when it follows every key,
the sampling rate and capacity it picks, and the counts it reports per request."""
from __future__ import annotations

import os
import random

import pytest

from kvrt.runtime.cache import shadow_lru
from kvrt.runtime.cache.shadow_lru import MIN_ENTRIES, ShadowLRU
from tests.runtime.cache import cache_reference as ref


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


@pytest.mark.parametrize("capacity", [40, 5000])
def test_c_observe_equals_the_python_reference(capacity, monkeypatch):
    """`observe` in C (runtime/cache/_cache_core.c shadow_observe) reports the same counts and
    leaves the same keys in the same order as its Python reference, on requests that share
    prefixes, come back, and overflow the shadow (followed exactly, and sampled)."""
    rng = random.Random(3)
    prefixes = [_keys(60) for _ in range(8)]
    requests = []
    for _ in range(300):
        keys = rng.choice(prefixes)[:rng.randrange(0, 60)] + _keys(rng.randrange(1, 30))
        requests.append((keys, rng.randrange(0, len(keys) + 1), rng.randrange(0, len(keys) + 1)))
    fast = ShadowLRU(capacity)
    got = [(fast.observe(k, u, s), list(fast._od)) for k, u, s in requests]
    monkeypatch.setattr(shadow_lru, "_observe_c", ref.shadow_observe)
    slow = ShadowLRU(capacity)
    assert got == [(slow.observe(k, u, s), list(slow._od)) for k, u, s in requests]
    assert any(seen for (seen, _, _), _ in got) and any(lru for (_, _, lru), _ in got)
    with pytest.raises(ValueError):
        fast.observe([b"short"], 1, 0)
