"""Eviction steered between reuse order and recency order by what LRU would have served
(`--eviction adaptive`, the default): the `gaps` ranking (runtime/cache/policies/gaps.py: release
time plus a bonus for reuse that is expected back in time), whose bonus is scaled by a weight
that follows a sampled shadow of an LRU cache of the same size (runtime/cache/shadow_lru.py).

Why: a ranking by reuse wins big where reuse comes back later than recency order can hold it
(the conversation trace at 20,000 blocks), and loses to LRU where its guess of which blocks come
back is wrong for the workload (a held-out trace at 40,000 blocks lost two points with `gaps`).
Any fixed rule for when the bonus pays is tuned to the traces it was tuned on. Measuring instead
is cheap: the cache replays each request's sampled keys through the shadow LRU and tells the
policy, over the same keys, how many blocks it served and how many LRU would have (`steer`).
Once per window (eight shadow turnovers of sampled lookups, so that a change of weight has had
time to show in what the cache holds), the weight goes down a step when the cache served fewer
of the window's sampled blocks than LRU would have by MARGIN of the lookups, up a step when it
served more by as much, and stays in between (a window of one-off prompts, which neither serves, says
nothing): it settles where reuse order pays, and at zero, which is exactly LRU's order, where
it does not. At zero the cache cannot beat
LRU, so the weight is probed again (one step) after a wait that doubles with every probe that
failed, which keeps the cost of probing a vanishing share of the windows while a workload that
changes is still noticed. A window in which `gaps` itself gave (almost) no bonus says nothing
about the weight, and leaves it alone. It starts at 1 (the `gaps` policy), so a workload where
the bonus pays keeps all of it.

Prefix order and cost are those of `gaps` (a weight scales every block's bonus alike, so an
ancestor's is still never smaller than its descendants'); the shadow costs one C call and a
dictionary operation per sampled key per request. Both tiers' policies get the same signals,
so they steer together: one policy governs device and host tiers.
"""
from __future__ import annotations

import math

import numpy as np

from kvrt.runtime.cache.policies.gaps import ReuseGaps

# a window's lookups must show the cache ahead of LRU by this share for the weight to grow
# (and behind it by as much for it to shrink)
MARGIN = 0.002
Z = 2.0  # standard errors a window's difference must exceed to count (beyond MARGIN)
STEP = 1.0  # the weight moves by this much per window: all of the bonus or none
# a window whose mean `gaps` bonus scale is below this leaves the weight alone
IDLE_SCALE = 0.05


class Adaptive(ReuseGaps):
    """`gaps` with its bonus scaled by a weight steered by a shadow LRU's hits."""

    shadows_lru = True  # the cache runs a sampled shadow LRU and calls `steer` per request

    __slots__ = ("weight", "_seen", "_ours", "_lru", "_scale_sum", "_pushes", "_wait", "_idle", "_probing")

    def __init__(self, capacity: int, hits: np.ndarray):
        super().__init__(capacity, hits)
        self.weight = 1.0
        self._seen = self._ours = self._lru = 0
        self._scale_sum = 0.0  # the `gaps` scale summed over the window's pushes
        self._pushes = 0
        self._wait = 1      # windows at weight 0 before the next probe
        self._idle = 0      # windows spent at weight 0 since the last probe
        self._probing = False

    def bonus_scale(self) -> float:
        inner = super().bonus_scale()
        self._scale_sum += inner
        self._pushes += 1
        return self.weight * inner

    def steer(self, seen: int, ours: int, lru: int, window: int) -> None:
        """A request's `seen` sampled usable blocks: `ours` served by the cache, `lru` held by
        the shadow LRU; at the end of a window of `window` lookups, step the weight."""
        self._seen += seen
        self._ours += ours
        self._lru += lru
        if self._seen < window:
            return
        # a difference within Z standard errors is sampling noise, not a verdict (the two counts
        # are of the same sampled blocks, so their difference varies by at most their sum)
        noise = Z * math.sqrt(self._ours + self._lru) / self._seen
        ahead = (self._ours - self._lru) / self._seen
        margin = max(MARGIN, noise)
        idle = self._scale_sum < IDLE_SCALE * max(1, self._pushes)
        self._seen = self._ours = self._lru = self._pushes = 0
        self._scale_sum = 0.0
        if idle:
            return
        if ahead >= margin:
            self.weight = min(1.0, self.weight + STEP)
            self._wait, self._probing = 1, False
        elif self.weight > 0 and ahead < -margin:
            self.weight = max(0.0, self.weight - STEP)
            if self.weight == 0 and self._probing:
                self._wait *= 2  # the probe failed
            self._probing = False
        elif self.weight == 0:
            self._idle += 1
            if self._idle >= self._wait:
                self.weight, self._idle, self._probing = STEP, 0, True
