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
it does not. "By as much" is also beyond two standard errors of the difference, with the
request as the unit of sampling: a request's blocks are one prefix, found or lost together, so
in a small cache, where a window is a dozen requests, one lost document is a lump of hundreds
of blocks, not hundreds of independent misses, and does not flip the weight. When the weight
drops to zero the queued blocks lose their bonus too (`_drop_bonus`): the queue is in LRU's
order at once rather than once the bonuses already given have run out. At zero the cache cannot beat
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

import heapq
import math

import numpy as np

from kvrt.runtime.cache.policies.gaps import LEVEL_SPAN, ReuseGaps

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

    __slots__ = ("weight", "_seen", "_diff", "_sq", "_scale_sum", "_pushes", "_wait", "_idle", "_probing")

    def __init__(self, capacity: int, hits: np.ndarray):
        super().__init__(capacity, hits)
        self.weight = 1.0
        # the window's sampled lookups, and the sum and the sum of squares of its requests'
        # differences (blocks the cache served minus blocks the shadow LRU held)
        self._seen = self._diff = self._sq = 0
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
        d = ours - lru
        self._seen += seen
        self._diff += d
        self._sq += d * d
        if self._seen < window:
            return
        # a difference within Z standard errors is noise, not a verdict. The unit of sampling is
        # the request, not the block: a request's blocks are one prefix, found or lost together
        # (a document of hundreds of blocks), so the difference's variance is the sum of the
        # requests' squared differences; counted per block it would look hundreds of times
        # surer than it is, and a few lumps would flip the weight
        noise = Z * math.sqrt(self._sq) / self._seen
        ahead = self._diff / self._seen
        margin = max(MARGIN, noise)
        idle = self._scale_sum < IDLE_SCALE * max(1, self._pushes)
        self._seen = self._diff = self._sq = self._pushes = 0
        self._scale_sum = 0.0
        if idle:
            return
        if ahead >= margin:
            self.weight = min(1.0, self.weight + STEP)
            self._wait, self._probing = 1, False
        elif self.weight > 0 and ahead < -margin:
            self.weight = max(0.0, self.weight - STEP)
            if self.weight == 0:
                if self._probing:
                    self._wait *= 2  # the probe failed
                self._drop_bonus()
            self._probing = False
        elif self.weight == 0:
            self._idle += 1
            if self._idle >= self._wait:
                self.weight, self._idle, self._probing = STEP, 0, True

    def _drop_bonus(self) -> None:
        """Give every queued node the priority of its release alone, as if pushed at weight 0.
        Why: a weight of 0 scales only later pushes; the blocks queued with a bonus would
        otherwise keep it for as long as it lasts, ahead of the newer blocks LRU would keep
        (the order the weight just chose), and every switch to LRU order cost hits for a while.
        One pass over the heap's entries (a run's nodes share a release) and a heapify, at most
        once per window of eight turnovers: O(1) per pushed block amortised."""
        released, prio = self._released, self._prio
        prio[:] = released * LEVEL_SPAN + prio % LEVEL_SPAN
        for e in self._heap:
            nodes = e[4]
            i = max(e[5], 0)
            if i < len(nodes):
                e[0] = int(released[nodes[i]]) * LEVEL_SPAN + e[1]
        heapq.heapify(self._heap)
