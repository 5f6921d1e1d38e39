"""Eviction by age and reuse (`--eviction reuse`): a released block's priority is the time it was
released plus a bonus that grows with the logarithm of how many requests used it; the leaf of
lowest priority goes first.

Why not LRU: when requests come back to a prefix later than the cache can remember in recency
order (the conversation trace at 20,000 blocks: a conversation's next turn ~400 requests later,
the cache holding ~100 requests' blocks), LRU keeps only the most recent requests and serves
almost nothing. Three blocks in four of that trace are never used again, while a block that
several requests used is likely to be used again, and soon. Ranking by reuse keeps those
(shared system prompts, conversations that keep coming back) through long gaps, lets one-shot
tails leave first (scan resistance: a long unique prompt no longer flushes the cache), and the
age term still retires blocks whose popularity is over (a level buys a few cache turnovers, and
levels stop at a few uses). Use counts come from the cache's node
matrix (`hits`: matches since the block was cached, plus the requests that used it before, from
runtime/cache/use_sketch.py), so a block evicted and computed again keeps its history.

Self-tuning: protection only pays when reuse comes back later than recency order can hold it
(the conversation trace); when it comes back within a turnover (short interleaved chats, where a
block's newest turn is exactly what the next request needs), the bonus keeps finished
conversations' blocks in the way of live ones and loses to LRU. So the bonus is scaled by how
much of the recent reuse was "long": of the blocks a request found queued, those released more
than a turnover ago, plus the blocks recomputed although their key had been used before (a reuse
the cache had already lost), over all of them (a moving average). Recomputed blocks count even
when nothing is protected, so the scale can grow back from zero: with no long reuse the policy
is LRU but for one release per level, with mostly long reuse it has the full bonus.

Prefix order: every request that uses a block uses its prefix, so an ancestor has at least its
descendants' uses and is released no earlier: its priority is never lower, and on a tie the
lower level, then the older (deeper) entry goes first. A parent that becomes a leaf again
(`push_front`) is queued with the priority of its last release.

Cost: entries are whole batches (one per level present in a released path; levels grow toward
the root, so a path splits into a few runs), kept in one heap keyed by (priority, level,
order): O(log batches) per push, O(1) amortised per popped node (a batch is scanned once, with
lazily invalidated entries, as in runtime/cache/policies/lru.py); stale entries are compacted in one pass once
they outnumber the node ids twice, which bounds memory.
"""
from __future__ import annotations

import heapq

import numpy as np

from kvrt.runtime.cache.policies.base import EvictionPolicy

from kvrt.runtime.cache.core import (policy_discard as _discard_c, policy_release as _release_c, pop_live as _pop_c,
                                    stamp_runs as _stamp_runs_c)

# level of a use count: floor(2 * log2(1 + uses)), at most MAX_LEVEL (3 earlier uses): beyond
# that more protection only keeps popular but finished prefixes (an agent loop that ended) in
# the way of live ones
MAX_LEVEL = 4
LEVELS = np.minimum(np.floor(2 * np.log2(1 + np.arange(1024))), MAX_LEVEL).astype(np.int64)
# the priority bonus of one level, in cache turnovers: the releases it takes to release as many
# blocks as the cache has node ids (the clock ticks once per released path, which averages
# `_avg_push` blocks), so the protection a level buys scales with the cache and the requests; at
# most MAX_BONUS releases, so that a large cache does not keep yesterday's popular prefixes
TURNOVERS_PER_LEVEL = 2.5
MAX_BONUS = 500
# the bonus scale: 0 while at most LONG_LOW of the recent reuse is long, the full bonus from
# LONG_HIGH on, linear between; the average forgets a request's counts after ~1/(1 - DECAY)
# requests
LONG_LOW, LONG_HIGH = 0.5, 0.7
DECAY = 0.995


class ReuseLevels(EvictionPolicy):
    """One tier's evictable nodes, lowest (release time + bonus for reuse) first."""

    counts_uses = True  # the cache keeps use counts past eviction for it (runtime/cache/use_sketch.py)

    __slots__ = ("_hits", "_stamp", "_stamp_v", "_prio", "_heap", "_clock", "_serial", "_queued",
                 "_limit", "_capacity", "_avg_push", "_released", "_matched", "_long", "_reused")

    def __init__(self, capacity: int, hits: np.ndarray):
        self._hits = hits
        self._stamp = np.full(capacity, -1, dtype=np.int64)  # serial of the node's live entry
        self._stamp_v = memoryview(self._stamp)
        self._prio = np.zeros(capacity, dtype=np.int64)      # priority of its last push
        # entries: [priority, level, order, serial, nodes (array, then list once scanned), cursor]
        self._heap: list[list] = []
        self._clock = 0
        self._serial = 0
        self._queued = 0   # node entries in the heap, live or not
        self._limit = 2 * capacity + 1024
        self._capacity = capacity
        self._avg_push = 0.0  # blocks per released path, a moving average
        self._released = np.zeros(capacity, dtype=np.int64)  # clock of the node's last push
        self._matched = np.zeros(capacity, dtype=bool)       # matched since its last push
        # moving sums of long reuse and of all reuse (blocks); starting equal: full bonus
        self._long = self._reused = 1.0

    def __contains__(self, n: int) -> bool:
        return self._stamp_v[n] >= 0

    def push(self, nodes: np.ndarray) -> None:
        """Queue `nodes` (released, deepest first) with priority now + bonus for their reuse."""
        if not len(nodes):
            return
        now, avg = self._release(nodes)
        hits = self._hits[nodes]
        lv = LEVELS.take(hits, mode="clip")
        # at least one release per level: with none, equal priorities would leave the order to
        # tie-breaks that batched and one-at-a-time eviction do not share
        bonus = max(1, int(self.bonus_scale() * min(MAX_BONUS, TURNOVERS_PER_LEVEL * self._capacity / avg)))
        prio = now + bonus * lv
        self._prio[nodes] = prio
        # levels grow toward the root: a few runs, found and stamped in one C call (`nodes` int32)
        s = self._serial
        starts = _stamp_runs_c(self._stamp, nodes, lv, s)
        self._serial = s + len(starts)
        heap = self._heap
        for j, (a, b) in enumerate(zip(starts, starts[1:] + [len(nodes)])):
            heapq.heappush(heap, [int(prio[a]), int(lv[a]), s + j, s + j, nodes[a:b], -1])
        self._queued += len(nodes)
        if self._queued > self._limit:
            self._compact()

    def _release(self, nodes: np.ndarray) -> tuple[int, float]:
        """What every push of released `nodes` (int32, distinct) counts, here and in the policies
        built on this one: the release clock, the moving average release size, the reuse the
        cache had lost (blocks computed again although their key was used before; the per-node
        part in one C call, runtime/cache/_cache_core.c policy_release); returns (now, average
        release size)."""
        now = self._clock
        self._clock = now + 1
        avg = self._avg_push
        avg = self._avg_push = 0.99 * avg + 0.01 * len(nodes) if avg else float(len(nodes))
        lost = _release_c(self._hits, self._matched, self._released, nodes, now)
        self._long += lost
        self._reused += lost
        return now, avg

    def push_front(self, n: int) -> None:
        """Queue `n` again with the priority of its last release, ahead of its equals."""
        s = self._serial
        self._serial = s + 1
        self._stamp_v[n] = s
        p = int(self._prio[n])
        heapq.heappush(self._heap, [p, int(LEVELS[min(self._hits[n], len(LEVELS) - 1)]), -s, s, [n], 0])
        self._queued += 1

    def push_front_run(self, nodes: list[int]) -> None:
        """`push_front` of each of `nodes` (none queued), the last one first, so that they come
        back in this order: what an eviction run cut short gives back. One heap entry per stretch
        of equal priority and level instead of one per node (a cut run gives back hundreds, and
        `pop_many` then takes them a stretch at a time); the order is the same, since such
        entries sort by priority, level, then push order, and a later push sorts first."""
        if not nodes:
            return
        a = np.array(nodes, dtype=np.int32)
        prio = self._prio[a]
        lv = LEVELS.take(self._hits[a], mode="clip")
        cuts = np.flatnonzero((prio[1:] != prio[:-1]) | (lv[1:] != lv[:-1])).tolist()
        starts = [0] + [c + 1 for c in cuts]
        ends = starts[1:] + [len(nodes)]
        for i in range(len(starts) - 1, -1, -1):  # the last stretch first, as one by one
            s = self._serial
            self._serial = s + 1
            run = a[starts[i]:ends[i]]
            self._stamp[run] = s
            heapq.heappush(self._heap, [int(prio[starts[i]]), int(lv[starts[i]]), -s, s,
                                        nodes[starts[i]:ends[i]], 0])
        self._queued += len(nodes)

    def bonus_scale(self) -> float:
        """The share of the reuse bonus in force (0: LRU; 1: the full bonus)."""
        f = self._long / self._reused
        return min(1.0, max(0.0, (f - LONG_LOW) / (LONG_HIGH - LONG_LOW)))

    def discard(self, nodes: np.ndarray) -> None:
        """Take `nodes` out (a request matched them) and count how many of the queued ones were
        released more than a turnover ago: reuse that recency order alone would have lost (per
        node in one C call, runtime/cache/_cache_core.c policy_discard)."""
        avg = self._avg_push
        nodes = np.ascontiguousarray(nodes, dtype=np.int32)  # (a reset's are int64)
        queued, long = _discard_c(self._stamp, self._released, self._matched, nodes, self._clock,
                                  self._capacity / avg if avg else 0.0)
        if queued and avg:
            self._long = DECAY * self._long + long
            self._reused = DECAY * self._reused + queued

    def discard_one(self, n: int) -> None:
        self._stamp_v[n] = -1

    def pop(self) -> int:
        """The queued node of lowest priority, taken out; -1 if none."""
        heap, stamp = self._heap, self._stamp_v
        while heap:
            e = heap[0]
            nodes, i, s = e[4], e[5], e[3]
            if i < 0 or not isinstance(nodes, list):  # (an array until scanned here)
                nodes = e[4] = nodes.tolist() if not isinstance(nodes, list) else nodes
                i = max(i, 0)
            end = len(nodes)
            while i < end:
                n = nodes[i]
                i += 1
                if stamp[n] == s:
                    e[5] = i
                    stamp[n] = -1
                    return n
            heapq.heappop(heap)
            self._queued -= end
        return -1

    def pop_many(self, k: int) -> np.ndarray:
        """Up to `k` nodes, as `k` calls of `pop` would return them: nothing is pushed meanwhile,
        so the heap's top entry stays on top until it is used up. The walk of the heap (each
        entry scanned from its cursor, used-up entries popped) is one C call
        (runtime/cache/_cache_core.c pop_live), into one array."""
        out = np.empty(k, dtype=np.int32)
        got, dropped = _pop_c(self._heap, self._stamp, k, out)
        self._queued -= dropped
        return out[:got]

    def members(self) -> list[int]:
        """Queued nodes through their live entries, in eviction order."""
        stamp = self._stamp_v
        out = []
        for e in sorted(self._heap):
            nodes = e[4] if isinstance(e[4], list) else e[4].tolist()
            out += [n for n in nodes[max(e[5], 0):] if stamp[n] == e[3]]
        return out

    def stamped(self) -> list[int]:
        return np.nonzero(self._stamp >= 0)[0].tolist()

    def _compact(self) -> None:
        """Drop dead entries: keep each batch's live nodes, forget empty batches."""
        heap = []
        queued = 0
        for e in self._heap:
            nodes = np.asarray(e[4][max(e[5], 0):], dtype=np.int32)
            live = nodes[self._stamp[nodes] == e[3]]
            if len(live):
                heap.append([e[0], e[1], e[2], e[3], live, -1])
                queued += len(live)
        heapq.heapify(heap)
        self._heap = heap
        self._queued = queued
