"""Eviction that follows reuse order only as far as it has paid against recency order, block by
block (`--eviction adaptive`, the default).

Why: ranking blocks by reuse (`gaps`, runtime/cache/policies/gaps.py: release time plus a bonus
for reuse expected back in time) wins big where reuse comes back later than recency order can
hold it (the conversation trace at 20,000 blocks), and loses to LRU where its guess of which
blocks come back is wrong (sessions that slow down as they age: their most used blocks are the
least likely back soon). A verdict taken per window of lookups comes too late and too noisily
on a trace of a few thousand requests; here the comparison is exact, block by block.

Structure: the queue is a recency segment R (every released node, in LRU order) and a
protected segment P (nodes that left R's old end with a `gaps` bonus, in `gaps`' order). R is
always the most recently used blocks, so an LRU cache of the same size holds R, the nodes in use
and the newest |P| of the nodes that left R and were not used since (live exits): the cache
differs from LRU's only by what P displaces. So each block's fate tells how P did: a hit on a
live exit outside those is a block LRU would have missed (a gain); a miss on one of them is a
block LRU would have served (a loss). Live exits are counted per release and marked by a bit
per block serial; a missed block is found among them by when its key was last used and its
depth (a release pushes its path deepest first). The policy remembers the keys of blocks gone
from the cache itself (their last release and uses, written when they leave: a cache that evicts
nothing pays nothing for it), which also gives a computed block the uses `gaps` ranks by. The
eviction order is `gaps`' (R's oldest by its release alone against P's lowest with its bonus,
the lower goes first), with P held to a budget: the gains minus the losses so far (the bank)
plus an allowance, never below 0. The allowance is EXPLORE of the capacity, RATE of the lookups,
and LEAD of the lead `gaps`' order with no budget would have over LRU so far, when it has one,
at most LEAD_CAP of the capacity plus LEAD_RATE of the lookups: the evidence that a larger P
pays, which it may then risk (the part that grows with the lookups lets a workload whose reuse
order pays only later, after P has spent its first allowance, try again). That lead is read
from this cache's own blocks, both ways: `gaps`' order holds the blocks of the latest due
releases (release plus bonus), as many as the cache holds, so with F the lowest due release at
which as many evicted blocks are due at F or later as queued ones before F (counts per due
release; runtime/cache/_cache_core.c a_frontier), a matched or missed block counts +1 if it is
due at F or later (`gaps` would have held it) and -1 if LRU would have held it. Counting only
the misses `gaps` would have served (what it gains, not what it gives up for them) read a large
lead where `gaps` loses to LRU (sessions that slow down as they age), and the allowance it
earned was spent there.
A victim that still has a device child goes back to P ranked last, rather than to the cache to
be parked. A pop moves nodes between the segments and cannot be given back, so
a run popped at once ends where one-at-a-time eviction would queue a parent to go next (its
last device child taken; in a host tier's queue, its last child dropped). All the per-block
work is in C (runtime/cache/_cache_core.c adapt_*), one call per released, matched, missed or
evicted run; its Python reference is tests/runtime/cache/cache_reference.py's adapt_*, which
tests/runtime/cache/test_cache_core.py holds it to, state for state.

The bound, structural rather than windowed: a loss needs a block of P's, P never holds more than
the budget, and every loss lowers the bank by a block. So from a cold cache, at every request,
the blocks it served are at least LRU's minus the largest allowance it has had (the lead's
part can shrink; a debt P ran up under a larger allowance is kept, not forgiven: 1/64 + 1/4 of
the capacity at most, plus 0.15% of the lookups); over any stretch it loses at most the lead
over LRU it had at the stretch's start (the bank keeps up to BANK_CAP capacities of it) plus
that allowance. The
counts are exact for requests served one after another (the benchmark's replay, where the
ledger is never ahead of the truth) and close with requests in flight together. tests/runtime/cache/test_adaptive_bound.py checks both on
generated traces against an LRU cache replayed beside it, from a cold cache and over every
window of two turnovers. The price: where protection pays only once P is large (a small P
churns before its blocks come back), P grows with what it earns, and the policy gets there
later than `gaps` does (the held-out cells where it trails `gaps`: docs/benchmarks.md, the
adaptive policy), or never where a small P loses to LRU.

The share of `gaps`' bonus in force (`bonus_scale`) is the share of long reuse as `gaps` would
read it, whatever this policy's order: a queued block matched more than a turnover after its
release, or a missed block whose key, or a deeper one of the same request (a prefix is used
whenever a deeper block is), is remembered as used before: reuse the cache lost (adapt_missed's
`reused`). Read from this policy's own hits and recomputed blocks alone it was self-fulfilling:
under an order close to LRU's no hit is long, the memory of evicted keys loses uses, and the
bonus never started where it would have paid.

A host tier's queue (the same class) takes the device's budget share (`follows`): the host tier
has no misses of its own to judge by.
"""
from __future__ import annotations

import numpy as np

from kvrt.runtime.cache.core import (adapt_discard as _discard_c, adapt_forget as _forget_c, adapt_front as _front_c,
                                    adapt_missed as _missed_c, adapt_pop as _pop_c, adapt_push as _push_c,
                                    adapt_recall as _recall_c, ghost_ages as _ghost_c)
from kvrt.runtime.cache.nodes import CHILD, NDEV, NEXT, PARENT
from kvrt.runtime.cache.policies.base import EvictionPolicy
from kvrt.runtime.cache.policies.gaps import (HOLD, LEVEL_SPAN, LONG_HIGH, LONG_LOW, MAX_TURNOVER, REACH,
                                              REACH_TWICE)
from kvrt.runtime.cache.policies.reuse import DECAY, LEVELS

# the allowance P may lose before it has won anything: a share of the capacity, and a share of
# every lookup (so that a workload that changes can be tried again, at a bounded cost)
EXPLORE = 1 / 64
RATE = 0.0005
# and a share of the lead `gaps`' order with no budget would have over LRU (the blocks it would
# have served beyond LRU's minus those LRU would have served beyond its): the evidence for a
# larger P, which it may then risk; at most LEAD_CAP of the capacity plus LEAD_RATE of the
# lookups, so that a workload whose reuse order starts to pay late (after P has lost its first
# allowance) can try again as the evidence comes in
LEAD, LEAD_CAP, LEAD_RATE = 1.0, 1 / 4, 0.001
# the lead it remembers, either way, in multiples of that cap: a workload that turns (from where
# `gaps` loses to where it wins, or back) turns the evidence within a few caps' worth of blocks
LEAD_MEMORY = 2
# the lead over LRU the bank keeps, in capacities: a lead of one capacity was spent by the first
# stretch of losses and P shrank though it was far ahead; the bound over any stretch is this
# much of the lead at its start plus the allowance
BANK_CAP = 4
# the lead over LRU, in capacities, at which `gaps`' whole bonus is in force whatever share of
# long reuse the recent requests show (a share of it below): a trace whose reuse turns short
# keeps the bonus while P is still winning with it
SCALE_LEAD = 1 / 4
# rows of the per-node matrix and indices of the scalars (runtime/cache/_cache_core.c adapt_*)
M_RSTAMP, M_PSER, M_BSER, M_REL, M_PRIO, M_QDUE, M_ROWS = range(7)
A_CLOCK, A_SERIAL, A_RHEAD, A_RTAIL, A_HSIZE, A_NP, A_TB, A_ABOVE, A_LASTEX, A_PSER, A_ORDER, A_FSTAMP, A_NPARK, A_PMAX, \
    A_F, A_XA, A_QB, A_NSTATE = range(18)


class Adaptive(EvictionPolicy):
    """One tier's evictable nodes: a recency segment and a protected one, in `gaps`' order with
    the protected segment held to what it has won against LRU."""

    remembers = True      # it remembers the blocks gone from the cache (`forget`, `recall`)
    sees_misses = True    # the cache calls `missed` with every counted request's missed blocks

    __slots__ = ("_hits", "_n", "_m", "_f", "_r", "_h", "_t", "_bits", "_st", "_args", "_tree", "_scratch", "_rstamp", "_pser",
                 "_ghost", "_due", "_table", "_forgot", "lead", "most", "_avg_push", "_long", "_reused", "bank", "lookups", "gains", "losses", "_leader",
                 "_parks", "_links")

    def __init__(self, capacity: int, hits: np.ndarray):
        n = capacity
        self._hits = hits
        self._n = n
        self._m = np.zeros(M_ROWS * n, dtype=np.int64)  # per node, side by side (one cache line)
        self._m[M_RSTAMP::M_ROWS] = -1
        self._m[M_PSER::M_ROWS] = -1
        self._m[M_QDUE::M_ROWS] = -1
        self._f = np.zeros(3 * n, dtype=np.uint8)  # per node: live exit, spare, parked
        self._r = np.full(2 * (2 * n + 1024), -1, dtype=np.int64)  # R's ring of [node, stamp]
        self._h = np.zeros(4 * (n + 1024), dtype=np.int64)         # P's heap, entries of 4
        # per release: first serial, length, live exits; per due release: queued, evicted
        self._t = np.zeros(5 * (n + 1024), dtype=np.int64)
        self._bits = np.zeros(4 * n + 65536, dtype=np.uint8)        # per block serial: a live exit
        self._due = np.zeros(len(self._bits), dtype=np.int64)       # and, evicted, the release its bonus lasts to
        self._st = np.zeros(A_NSTATE, dtype=np.int64)
        self._st[A_LASTEX] = -1
        self._st[A_FSTAMP] = 1 << 62  # stamps of nodes queued at R's old end (block serials stay below)
        self._args = (self._m, self._f, self._r, self._h, self._t, self._bits, self._st, hits)
        # the node matrix `hits` is a row of (a victim with a device child left is parked by the
        # cache: still held), or a stand-in without children for a queue used on its own
        tree = hits.base if isinstance(hits.base, np.ndarray) and hits.base.ndim == 2 else None
        if tree is None or tree.dtype != np.int32 or tree.shape[1] != n:
            tree = np.zeros((NDEV + 1, n), dtype=np.int32)
            tree[PARENT] = -1
        self._tree = tree
        self._scratch = np.zeros(n, dtype=np.int32)
        self._rstamp = memoryview(self._m[M_RSTAMP::M_ROWS])
        self._pser = memoryview(self._m[M_PSER::M_ROWS])
        self._ghost = np.full(n, -1, dtype=np.int64)  # releases since a just-recorded node's key was used
        # per key gone from the cache: its last release and uses, two slots of 8 bytes each; a
        # cache that evicts nothing never touches it (the pages are never even mapped in)
        self._table = np.zeros(2 * (1 << max(10, (32 * n - 1).bit_length())), dtype=np.uint64)
        self._forgot = np.zeros(1, dtype=np.uint8)  # anything in it yet (set by C too: `remember_into`)
        self._avg_push = 0.0
        self._long = self._reused = 1.0  # moving sums of long reuse and of all reuse (`gaps`' scale)
        self.bank = 0          # blocks served beyond LRU minus blocks LRU would have served beyond these
        self.lookups = 0       # usable blocks of the requests counted so far
        self.gains = self.losses = 0
        self.lead = 0.0        # blocks `gaps`' order with no budget would have served beyond LRU's
        self.most = 0.0        # the largest allowance so far
        self._leader: Adaptive | None = None
        self._parks: list[int] = []  # nodes the cache parks if the next pop_many hands them out
        # the node matrix's child and sibling rows for a host tier's queue (`follows`), whose pop
        # stops where a victim leaves its unqueued parent childless (-1: a device queue's)
        self._links = (-1, -1)

    # ---- the budget
    def allowance(self) -> float:
        """What P may lose before it has won anything (blocks)."""
        return EXPLORE * self._n + RATE * self.lookups + min(LEAD * max(0, self.lead),
                                                             LEAD_CAP * self._n + LEAD_RATE * self.lookups)

    def budget(self) -> int:
        """How many nodes P may hold now."""
        if self._leader is not None:
            return int(self._leader.share() * self._n)
        return int(min(self._n, max(0.0, self.bank + self.allowance())))

    def share(self) -> float:
        """The budget as a share of the capacity (what a follower's budget is)."""
        return self.budget() / self._n

    def follows(self, leader: EvictionPolicy) -> None:
        """Take the budget from `leader`'s share (a host tier's queue follows the device's); as a
        host tier's queue, a run popped ends after a victim whose drop leaves its parent a leaf
        the cache queues next (runtime/cache/_cache_core.c adapt_pop)."""
        if isinstance(leader, Adaptive):
            self._leader = leader
            if self._tree.shape[0] > NEXT:
                self._links = (CHILD, NEXT)

    def _add_lead(self, d: int) -> None:
        """Count `d` more blocks of `gaps`' lead over LRU, remembering at most LEAD_MEMORY caps
        of it either way (so that the evidence turns with the workload)."""
        self.most = max(self.most, self.allowance())
        c = LEAD_MEMORY * (LEAD_CAP * self._n + LEAD_RATE * self.lookups)
        self.lead = min(c, max(-c, self.lead + d))

    def _settle(self, won: int, lost: int) -> None:
        self.gains += won
        self.losses += lost
        # (a debt is never forgiven: P's losses are held to the largest allowance it has had, the
        # lead's part of which can shrink)
        a = self.allowance()
        self.bank = int(min(BANK_CAP * self._n - a, max(-max(a, self.most), self.bank + won - lost)))

    def bonus_scale(self) -> float:
        """The share of `gaps`' bonus in force: 0 while at most LONG_LOW of the recent reuse came
        back later than a turnover, all of it from LONG_HIGH on (runtime/cache/policies/gaps.py);
        and at least the lead over LRU that P has won, as a share of SCALE_LEAD capacities. The
        share of long reuse counts the queued blocks matched more than a turnover after their
        release (`discard`) and the missed ones that were reuse the cache lost (`missed`), as
        `gaps` reads it whatever this policy's order; the lead is what P's bonus has already
        served beyond LRU (a policy that has won nothing keeps the share alone: short traces
        where reuse order does not pay stay in LRU's order)."""
        f = self._long / self._reused
        lead = max(0.0, self.bank) / (SCALE_LEAD * self._n)
        return min(1.0, max(0.0, (f - LONG_LOW) / (LONG_HIGH - LONG_LOW), lead))

    # ---- the interface
    def __contains__(self, n: int) -> bool:
        return self._rstamp[n] >= 0 or self._pser[n] >= 0

    def push(self, nodes: np.ndarray) -> None:
        """A released path (deepest first) joins R, each node ranked for P as `gaps` ranks it."""
        if not len(nodes):
            return
        avg = self._avg_push
        avg = self._avg_push = 0.99 * avg + 0.01 * len(nodes) if avg else float(len(nodes))
        turnover = self._n / avg
        unit = self.bonus_scale() * min(MAX_TURNOVER, turnover)
        _push_c(*self._args, np.ascontiguousarray(nodes, dtype=np.int32), LEVELS, HOLD, unit,
                REACH * turnover, REACH_TWICE * turnover, LEVEL_SPAN, self._ghost, self._due)

    def push_front(self, n: int) -> None:
        _front_c(*self._args, np.array([n], dtype=np.int32), LEVEL_SPAN, self._due)

    def push_front_run(self, nodes: list[int]) -> None:
        if nodes:
            _front_c(*self._args, np.array(nodes, dtype=np.int32), LEVEL_SPAN, self._due)

    def forget(self, nodes: np.ndarray, keys: list, hits: np.ndarray | None = None) -> None:
        """`nodes` leave the cache: remember their keys, last release and uses, for when a
        request misses them (runtime/cache/_cache_core.c adapt_forget): keys[i] and hits[i] when
        `hits` is given (taken before the nodes were freed), else the node keys (keys[node]) and
        their `hits` rows. Writing here, not on every match, is what keeps a cache that hits
        from paying for the memory."""
        aligned = hits is not None
        self._forgot[0] = 1
        _forget_c(self._m, hits if aligned else self._hits, self._table, keys,
                  np.ascontiguousarray(nodes, dtype=np.int32), aligned)

    def remember_into(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The records, table and mark `forget` writes, for an eviction run that remembers the
        keys it drops itself (runtime/cache/_cache_core.c drop_chains)."""
        return self._m, self._table, self._forgot

    def recall(self, keys: list[bytes], start: int) -> tuple[np.ndarray, np.ndarray] | None:
        """For keys[start:]: how many releases ago each was last used (-1: not remembered) and
        by how many requests (0); None while nothing has left the cache (nothing to recall)."""
        if not self._forgot[0]:
            return None
        k = max(0, len(keys) - start)
        ages, uses = np.empty(k, dtype=np.int64), np.empty(k, dtype=np.int32)
        _recall_c(self._table, keys, start, int(self._st[A_CLOCK]), ages, uses)
        return ages, uses

    def recorded(self, nodes: np.ndarray, ages: np.ndarray) -> None:
        """`nodes` (a path, root side first) were computed; their keys were last used `ages`
        releases ago: an age is raised to its ancestors' (runtime/cache/_cache_core.c ghost_ages)."""
        _ghost_c(self._ghost, nodes, ages)

    def missed(self, ages: np.ndarray, usable: int) -> None:
        """A counted request's blocks after its matched prefix, up to its `usable` ones: their keys
        were last used `ages` requests ago (-1: never). Those LRU would have served are losses;
        those up to the last remembered one are long reuse (the share `bonus_scale` reads); those
        `gaps`' order would have served, less those LRU would have, are its lead."""
        self.lookups += usable
        if not len(ages):
            return
        lost, lead, reused = _missed_c(*self._args, np.ascontiguousarray(ages, dtype=np.int64), usable - len(ages),
                                       self._due)
        self._add_lead(lead)
        self._long += reused
        self._reused += reused
        self._settle(0, lost)

    def discard(self, nodes: np.ndarray) -> None:
        """`nodes` are matched: out of both segments. Counts, as `gaps` does, how many queued ones
        were released more than a turnover ago, and, per block, what P served that LRU would not
        have (gains), and of the queued ones, those `gaps`' order would have held less those LRU
        would have (its lead)."""
        avg = self._avg_push
        queued, long, won, lead = _discard_c(*self._args, np.ascontiguousarray(nodes, dtype=np.int32),
                                              self._n / avg if avg else 0.0, self._due)
        self._add_lead(lead)
        if queued and avg:
            self._long = DECAY * self._long + long
            self._reused = DECAY * self._reused + queued
        if won:
            self._settle(won, 0)

    def discard_one(self, n: int) -> None:
        """`n` leaves the queues without serving a request (its node freed or detached, or
        adopted by a request that computed its block itself): nothing is counted, neither a
        gain nor reuse. A node neither queued nor parked (evicted: what became of its block is
        the ledger's, as when a host tier drops it in a batch) is left as it is."""
        if self._rstamp[n] >= 0 or self._pser[n] >= 0 or self._f[3 * n + 2]:
            _discard_c(*self._args, np.array([n], dtype=np.int32), 0.0, self._due)

    def pop(self) -> int:
        got = self.pop_many(1)
        return int(got[0]) if len(got) else -1

    def parks(self, nodes: list[int]) -> None:
        self._parks = nodes

    def pop_many(self, k: int) -> np.ndarray:
        """As `k` pops. A victim's parent whose device children are not all taken before it
        stays (runtime/cache/_cache_core.c adapt_pop counts them in `scratch`); a child the
        cache will park (`parks`) is never taken, so it counts one less from the start."""
        out = np.empty(k, dtype=np.int32)
        if not self._parks:  # the usual call: nothing to count beforehand, nothing to undo
            return out[:_pop_c(*self._args, out, k, self.budget(), LEVEL_SPAN, self._tree, PARENT, NDEV, *self._links,
                               self._scratch, self._due)]
        scratch, parent = self._scratch, self._tree[PARENT]
        rstamp, pser = self._rstamp, self._pser
        held = [int(parent[v]) for v in self._parks if (rstamp[v] >= 0 or pser[v] >= 0) and 0 <= parent[v] < self._n]
        self._parks = []
        for p in held:
            scratch[p] -= 1
        try:
            return out[:_pop_c(*self._args, out, k, self.budget(), LEVEL_SPAN, self._tree, PARENT, NDEV, *self._links,
                               scratch, self._due)]
        finally:
            scratch[held] = 0

    def members(self) -> list[int]:
        """R's live nodes, oldest first, then P's by rank."""
        st, r, n = self._st, self._r, self._n
        cap = len(r) // 2
        out = []
        for x in range(int(st[A_RHEAD]), int(st[A_RTAIL])):
            v, s = int(r[2 * (x % cap)]), int(r[2 * (x % cap) + 1])
            if 0 <= v < n and self._rstamp[v] == s:
                out.append(v)
        h = self._h.reshape(-1, 4)[:int(st[A_HSIZE])]  # entries [priority, order, node, serial]
        live = [(int(k), int(o), int(v)) for k, o, v, s in h if self._pser[int(v)] == s]
        return out + [v for _, _, v in sorted(live)]

    def stamped(self) -> list[int]:
        return np.nonzero((self._m[M_RSTAMP::M_ROWS] >= 0) | (self._m[M_PSER::M_ROWS] >= 0))[0].tolist()
