"""What LRU would have served: a sampled shadow of an LRU cache over block keys, so that an
adaptive eviction policy (runtime/cache/policies/adaptive.py) can tell, while it runs, whether
its own order is beating recency order or losing to it.

Why sampled: a full shadow costs a dictionary operation per block of every request, as much as
the cache's own work. A key is followed only if its hash falls in a fixed fraction `rate` of
the hash space, and the shadow holds `rate` times the cache's capacity: an LRU cache's hit ratio
on a uniform sample of keys, at the same fraction of the capacity, is that of the full cache
(spatial sampling, as miss-ratio-curve tools do), and keys are uniform hashes. The shadow keeps at
least MIN_ENTRIES keys (all of them for a small cache), so its estimate stays steady.

Prefix-aware as the cache is: a request's blocks are used root first and queued deepest first,
so an ancestor is always more recent than its descendants and LRU never keeps a block without
its prefix; the shadow makes the request's keys the most recent, root last, the same way.

The comparison is over the same sampled keys: `observe` counts, of a request's sampled usable
blocks (those a match may serve), how many the real cache served and how many the shadow holds.
Both counts see the same keys, so the noise of sampling mostly cancels in their difference.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from kvrt.runtime.cache.core import shadow_observe as _observe_c

MIN_ENTRIES = 1024


class ShadowLRU:
    """A sampled LRU cache of `capacity` blocks (the cache's device plus host tiers)."""

    __slots__ = ("_od", "capacity", "_threshold", "rate")

    def __init__(self, capacity: int):
        self.rate = min(1.0, MIN_ENTRIES / max(1, capacity))
        # keys whose hash word (runtime/cache/_cache_core.c shadow_observe) is below this are followed
        self._threshold = min(1 << 32, int(self.rate * (1 << 32)))
        self.capacity = max(1, round(self.rate * capacity))
        self._od: OrderedDict[bytes, None] = OrderedDict()

    def observe(self, keys: Sequence[bytes], usable: int, served: int) -> tuple[int, int, int]:
        """A request with block `keys` matched `served` of its first `usable` (the ones a match
        may serve); returns (sampled usable blocks, how many of them the cache served, how many
        the shadow LRU held), then makes the request's sampled keys the most recent, the root
        side last. One C call (runtime/cache/_cache_core.c shadow_observe) on the OrderedDict."""
        return _observe_c(self._od, keys, self._threshold, usable, served, self.capacity)

    def __len__(self) -> int:
        return len(self._od)
