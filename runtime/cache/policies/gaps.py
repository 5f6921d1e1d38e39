"""Eviction by age, reuse and reuse gap (`--eviction gaps`): the `reuse` policy's ranking
(runtime/cache/policies/reuse.py: release time plus a bonus for how many requests used a block), where a
block's protection also depends on how long its last reuse took to come back.

Why: protection costs room for as long as it lasts, and pays only if the block is used again
before it runs out. On the conversation trace at 20,000 blocks, a block used once before was
held ~2 turnovers past its release (its 5-turnover bonus minus how far the eviction frontier
lags behind) and only one in eight came back in that time, while the next reuse of a block
follows its last gap: a block whose last reuse took longer than its protection lasts is likely
to outlive it again. So a block used once before whose last gap exceeds REACH turnovers (twice
before: REACH_TWICE) gets no bonus, and the room goes to the blocks whose reuse fits: a longer
bonus for those (HOLD, in turnovers by earlier uses). Blocks used three times or more are kept
as in `reuse` (their gaps are short: popular prefixes).

Where the gap comes from: when a block is computed (again), the cache's use sketch
(runtime/cache/use_sketch.py remembers when each key was last used, in requests) says how long ago its
key was used, through `recorded`; that is where the long gaps are. A block found in the cache
came back within its protection: its gap is not looked at (nor on the host tier, which records
nothing), and it is kept as `reuse` would keep it. One request is one tick of the policy's
clock (one release) and of the sketch's.

Same self-tuning as `reuse` (the share of long reuse scales the bonus), except that with no
long reuse at all there is no bonus at all: the order is then exactly LRU's (release order,
deepest first), so short interleaved chats lose nothing to LRU. A bonus is the scale times the
hold, rounded down to whole releases, with no floor: a small scale is a small bonus, and a block
with no bonus (beyond its reach) has none. (A floor of one release per level, as `reuse` keeps
for its tie-breaks, is up to four releases, which in a small cache, where a turnover is one or
two releases, is a bonus of turnovers: without it `gaps` loses less to LRU at 1/64 of the
blocks of `qa` and `agents`, docs/benchmarks.md; here the level in a priority's low bits breaks
the ties.)

Prefix order: an ancestor has at least its descendants' uses and a gap no longer than theirs
(ages from the sketch are made so along a path), so its bonus is never smaller and leaves go
before their parents.
"""
from __future__ import annotations

import numpy as np

from kvrt.runtime.cache.core import gaps_rank as _rank_c, ghost_ages as _ghost_c
from kvrt.runtime.cache.policies.reuse import LEVELS, MAX_LEVEL, ReuseLevels

# bonus in cache turnovers by earlier uses (0, 1, 2, 3 or more): a block with no earlier use
# gets none (three in four are never used again); the rest as long as their reuse tends to take
HOLD = np.array([0.0, 6.0, 7.5, 10.0])
# a block used once (twice) before whose last gap was longer than this many turnovers gets no
# bonus: its reuse is not expected back while the bonus lasts
REACH, REACH_TWICE = 6.0, 10.0
# a turnover counts at most this many releases, so that a large cache does not keep yesterday's
# popular prefixes (the `reuse` policy's bound: 500 releases for 2.5 turnovers)
MAX_TURNOVER = 200
# priorities are (release + bonus) * LEVEL_SPAN + level: above any level (runtime/cache/policies/reuse.py)
LEVEL_SPAN = 8
# the bonus scale: 0 while at most LONG_LOW of the recent reuse is long, full from LONG_HIGH on;
# higher than `reuse`'s (0.5, 0.7): at 100,000 blocks of the conversation trace (~0.5 long)
# a partial bonus still lost a little to LRU
LONG_LOW, LONG_HIGH = 0.55, 0.75
assert MAX_LEVEL < LEVEL_SPAN


class ReuseGaps(ReuseLevels):
    """One tier's evictable nodes, lowest (release time + bonus for reuse that fits) first."""

    counts_uses = True  # use counts past eviction (runtime/cache/use_sketch.py)
    counts_gaps = True  # and when each key was last used: `recorded` gets the ages

    __slots__ = ("_ghost",)

    def __init__(self, capacity: int, hits: np.ndarray):
        super().__init__(capacity, hits)
        # requests since the key of a just-recorded node was last used (-1: unknown), read at
        # its next push
        self._ghost = np.full(capacity, -1, dtype=np.int64)

    def bonus_scale(self) -> float:
        """The share of the bonus in force (0: LRU; 1: the full bonus)."""
        f = self._long / self._reused
        return min(1.0, max(0.0, (f - LONG_LOW) / (LONG_HIGH - LONG_LOW)))

    def recorded(self, nodes: np.ndarray, ages: np.ndarray) -> None:
        """`nodes` were just recorded (computed); their keys were last used `ages` requests ago
        (-1: not known to have been used). `nodes` is a path from the root side: a block's key
        was used no more recently than its parent's, so an age is raised to its ancestors' (a
        sketch collision can only make one look recent), which also keeps the bonus from
        shrinking toward the root (a released path stays a few runs). One C call
        (runtime/cache/_cache_core.c ghost_ages)."""
        _ghost_c(self._ghost, nodes, ages)

    def push(self, nodes: np.ndarray) -> None:
        """Queue `nodes` (released, deepest first) with priority now + the bonus for their reuse,
        none for a block whose last reuse gap exceeds what its bonus would hold. The ranking,
        the stamps and the split into runs of equal priority are one C call
        (runtime/cache/_cache_core.c gaps_rank); along a path priorities grow toward the root, so
        a path is a few runs (a host tier's batch of swapped-out nodes is no path: any number)."""
        if not len(nodes):
            return
        now, avg = self._release(nodes)
        turnover = self._capacity / avg
        unit = self.bonus_scale() * min(MAX_TURNOVER, turnover)
        # the level in the low bits of a priority: no two levels share one (within a release,
        # deepest first), so a node queued again at the front (`push_front`, with its own
        # priority and level) goes back among its equals only
        s = self._serial
        self._serial = s + _rank_c(self._hits, self._ghost, self._prio, self._stamp, nodes, LEVELS, HOLD, now, unit,
                                   REACH * turnover, REACH_TWICE * turnover, LEVEL_SPAN, s, self._heap)
        self._queued += len(nodes)
        if self._queued > self._limit:
            self._compact()
