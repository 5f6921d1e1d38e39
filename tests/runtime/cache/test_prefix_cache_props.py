"""Property tests: random engines driving the prefix cache, with the invariants checked after
every step.

A state machine plays an engine and the cache-transfer ranks at once: it starts requests whose
prompts share prefixes, allocates, computes in chunks, releases, takes transfer tasks and reports
them done, short or failed in any order, and resets the cache with requests and tasks in flight.
After every step the cache's own
checker runs (per tier free + cached + used = total, no block owned twice, tree / key map / refs /
LRU queues consistent), and the machine checks what only a model of the engine can know:
- nothing is matched from the device or host unless its KV was written (computed by a request
  or read from storage) after the last reset;
- a request's referenced blocks are never evicted (they stay matchable) unless a failed
  swap-in or a reset dropped them;
- a reset leaves no cached block on either tier: each one is freed or, if a request or task
  holds it, in use until released;
- once every request is released and every task applied, every block is free or cached;
- every page a request's block tables point at (group 0's, and each side layer group's where
  its window still reads it) holds the KV of that block and group: the machine plays the
  worker and the copies too (a page holds what was computed into it, swaps and storage reads
  copy it), so a page freed or reused under a request, or a table out of step with the pages,
  shows as the wrong content.
The layer-group machine (`GroupsCacheMachine`) runs the same rules over a cache whose blocks
take a page per layer group, with sliding windows (runtime/cache/groups.py).
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvrt.runtime.cache.keys import BlockHasher, group_key
from kvrt.runtime.cache.policies.adaptive import BANK_CAP
from kvrt.runtime.cache.policies.base import make_policy
from kvrt.runtime.cache.prefix_cache import PrefixCache, TaskKind

BS = 2
BASES = [np.arange(1000 * b, 1000 * b + 40, dtype=np.int32) for b in range(3)]


class _Req:
    def __init__(self, tokens: np.ndarray, keys: list[bytes]):
        self.tokens = tokens
        self.keys = keys
        self.allocated = 0    # tokens with blocks
        self.computed = 0     # tokens the "worker" computed
        self.held = 0         # leading keys the cache must keep matchable for this request
        self.ready = True
        self.failed = False
        self.stale = False    # started before a reset: nothing of it stays matchable


class CacheMachine(RuleBasedStateMachine):
    POLICY = "lru"  # the eviction policy of both tiers
    GROUPS: list[tuple[int, ...]] = [()]  # side layer groups' windows in tokens (0: full attention)

    @initialize(device=st.integers(4, 24), host=st.sampled_from([0, 0, 3, 8, 16]),
                storage=st.booleans(), write_through=st.booleans(), data=st.data())
    def setup(self, device, host, storage, write_through, data):
        groups = data.draw(st.sampled_from(self.GROUPS))
        device *= 1 + len(groups)  # as many blocks of tokens
        # the storage tier starts with one prefix some earlier node wrote
        self.stored: set[bytes] = set(BlockHasher(BS).update(BASES[2][:30])) if storage else set()
        self.cache = PrefixCache(BS, device, host,
                                 storage_lookup=self._storage_lookup if storage else None,
                                 write_through=write_through and storage, policy=make_policy(self.POLICY),
                                 groups=groups)
        self.dev: dict[int, tuple] = {}   # device page -> what it holds: (key, group), or a partial block
        self.groups = len(groups)
        self.pages: dict[bytes, tuple] = {}  # a side group's page key -> (block key, group)
        self.host: dict[int, tuple] = {}
        self.written: set[bytes] = set()
        self.reqs: dict[int, _Req] = {}
        self.inflight = []
        self.before_reset: set[int] = set()  # tasks in flight at a reset: what they bring is not cached
        self.next_id = 0

    def _storage_lookup(self, keys) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.stored:
            n += 1
        return n

    def _live(self) -> list[int]:
        return sorted(self.reqs)

    # ---- the engine ----------------------------------------------------------------------
    @rule(base=st.integers(0, 2), length=st.integers(1, 40), tail=st.lists(st.integers(0, 3), max_size=5))
    def start(self, base, length, tail):
        self._start(base, length, tail)

    @rule(base=st.integers(0, 2), length=st.integers(1, 40), tail=st.lists(st.integers(0, 3), max_size=5))
    def whole_request(self, base, length, tail):
        """Start, compute and release a request in one step, as a busy engine would over time."""
        rid = self._start(base, length, tail)
        self._advance(rid, 1000)
        self.cache.release(rid)
        del self.reqs[rid]

    def _start(self, base, length, tail) -> int:
        tokens = np.concatenate([BASES[base][:length], np.array(tail, dtype=np.int32)])
        keys = BlockHasher(BS).update(tokens)
        for g in range(1, self.groups + 1):
            self.pages.update((group_key(k, g), (k, g)) for k in keys)
        rid = self.next_id
        self.next_id += 1
        m = self.cache.match(rid, keys, len(tokens))
        r = _Req(tokens, keys)
        hit = (m.device_tokens + m.host_tokens) // BS
        assert set(keys[:hit]) <= self.written, "matched a block whose KV was never written"
        assert set(keys[hit:hit + m.storage_tokens // BS]) <= self.stored
        assert m.cached_tokens < len(tokens)  # the last token is always computed
        r.held = hit
        r.ready = m.ready
        r.computed = hit * BS
        self.reqs[rid] = r
        if r.ready:
            self._check_pages(rid)
        return rid

    @rule(base=st.integers(0, 2), length=st.integers(1, 40), tail=st.lists(st.integers(0, 3), max_size=5))
    def received(self, base, length, tail):
        """A decode node's request: the KV of its whole prompt comes from a prefill node into
        pages held for it (a sliding group's only for the window it reads from its first
        token on), and is recorded once it arrived."""
        rid = self._start(base, length, tail)
        r = self.reqs[rid]
        n = len(r.tokens)
        if not r.ready or self.cache.allocate(rid, n, reads_from=n) is None:
            return
        r.allocated = -(-n // BS) * BS
        tables = [self.cache.block_table(rid)] + self.cache.group_tables(rid)
        for i in range(r.computed // BS, -(-n // BS)):
            for g, table in enumerate(tables):
                if g and i < self.cache._lo(g - 1, n):
                    assert table[i] < 0, "a page held for a block the request never reads"
                    continue
                self.dev[table[i]] = (r.keys[i], g) if (i + 1) * BS <= n else ("partial", rid, i)
        r.computed = n
        covered = self.cache.update(rid, n) // BS
        if not r.stale:
            self.written.update(r.keys[:n // BS])
            r.held = max(r.held, covered)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), extra=st.integers(1, 6))
    def decode_room(self, data, extra):
        rid = data.draw(st.sampled_from(self._live()))
        r = self.reqs[rid]
        want = len(r.tokens) + extra
        if self.cache.allocate(rid, want) is not None:
            r.allocated = max(r.allocated, -(-want // BS) * BS)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def advance(self, data, chunk):
        """Chunked prefill: allocate what the next chunk needs, compute it, report it."""
        self._advance(data.draw(st.sampled_from(self._live())), chunk)

    def _advance(self, rid: int, chunk: int) -> None:
        r = self.reqs[rid]
        if not r.ready or r.failed:
            return
        n = min(len(r.tokens), r.computed + chunk)
        if n > r.allocated:
            if self.cache.allocate(rid, n) is None:
                return
            r.allocated = -(-n // BS) * BS
        if n <= r.computed:
            return
        self._compute(rid, r, n)
        r.computed = n
        covered = self.cache.update(rid, n) // BS
        if not r.stale:  # (a request from before a reset records nothing more)
            self.written.update(r.keys[:n // BS])
            r.held = max(r.held, covered)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(self._live()))
        self.cache.release(rid)
        del self.reqs[rid]

    # ---- the cache-transfer ranks ----------------------------------------------------------
    @rule()
    def take(self):
        self.inflight += self.cache.take_tasks()

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), ok=st.booleans(), short=st.integers(0, 3))
    def finish(self, data, ok, short):
        task = self.inflight.pop(data.draw(st.integers(0, len(self.inflight) - 1)))
        read = None
        if task.kind is TaskKind.STORAGE2GPU and short and ok:
            read = max(0, len(task.keys) - short)  # a short read: only a prefix arrived
        self._apply(task, ok, read)

    def _compute(self, rid: int, r: _Req, n: int) -> None:
        """The worker writes positions [r.computed, n) into the request's pages of every group
        (a sliding group's too: a step writes every layer's K and V)."""
        tables = [self.cache.block_table(rid)] + self.cache.group_tables(rid)
        for i in range(r.computed // BS, -(-n // BS)):
            for g, table in enumerate(tables):
                page = table[i]
                assert page >= 0, f"block {i} of group {g} has no page to be computed into"
                self.dev[page] = (r.keys[i], g) if (i + 1) * BS <= n and i < len(r.keys) else ("partial", rid, i)

    def _check_pages(self, rid: int) -> None:
        """Every page the request reads holds its block's KV of its group."""
        r = self.reqs[rid]
        done = min(r.computed // BS, len(r.keys))
        table = self.cache.block_table(rid)
        for i in range(done):
            assert self.dev.get(table[i]) == (r.keys[i], 0), f"request {rid} block {i}: page {table[i]} holds {self.dev.get(table[i])}"
        for g, gt in enumerate(self.cache.group_tables(rid)):
            for i in range(self.cache._lo(g, r.computed), done):
                assert self.dev.get(gt[i]) == (r.keys[i], g + 1), \
                    f"request {rid} block {i} group {g + 1}: page {gt[i]} holds {self.dev.get(gt[i])}"
            for i in range(self.cache._lo(g, r.computed)):
                assert gt[i] < 0, f"request {rid} still holds block {i} of group {g + 1}, out of its window"

    def _apply(self, task, ok: bool, read: int | None) -> None:
        if ok:  # the ranks' copies
            if task.kind is TaskKind.SWAP2CPU:
                for d, h in zip(task.device_blocks, task.host_blocks):
                    self.host[h] = self.dev.get(d)
            elif task.kind is TaskKind.SWAP2GPU:
                for d, h in zip(task.device_blocks, task.host_blocks):
                    self.dev[d] = self.host.get(h)
            elif task.kind is TaskKind.STORAGE2GPU:
                for d, key in list(zip(task.device_blocks, task.keys))[:len(task.keys) if read is None else read]:
                    self.dev[d] = self.pages.get(key, (key, 0))
        out = self.cache.apply_task_result(task.task_id, ok, blocks=read)
        if task.kind is TaskKind.STORAGE2GPU and task.task_id not in self.before_reset:
            loaded = len(task.keys) if read is None and ok else (read or 0)
            self.written.update(task.keys[:loaded])
        if task.kind is TaskKind.GPU2STORAGE and ok:
            self.stored.update(task.keys)
        for rid in out.failed:
            self.reqs[rid].failed = True
        for rid, cached in out.ready.items():
            r = self.reqs[rid]
            r.ready = True
            r.computed = max(r.computed, cached)
            if not r.stale:
                r.held = max(r.held, cached // BS)

    @rule()
    def settle(self):
        """The ranks catch up: every issued task comes back done."""
        self.inflight += self.cache.take_tasks()
        while self.inflight:
            self._apply(self.inflight.pop(0), True, None)

    @rule(roll=st.integers(0, 3))
    def reset(self, roll):
        """An operator resets the cache, whatever is in flight."""
        if roll:  # rarer than the rest: a reset leaves little to test
            return
        before = self.cache.block_usage()
        got = self.cache.reset()
        u = self.cache.check()
        assert u["device_cached"] == 0 and u["host_cached"] == 0, "a cached block outlived the reset"
        assert (got.device + got.held_device, got.host + got.held_host) == \
            (before["device_cached"], before["host_cached"]), (got, before)
        assert u["host_free"] == before["host_free"] + got.host
        self.written.clear()
        self.before_reset.update(t.task_id for t in self.inflight)
        self.before_reset.update(got.storage_tasks)
        for r in self.reqs.values():
            r.stale = True
            r.held = 0
            assert self.cache.lookup(r.keys) == 0, "a block cached before the reset is still matchable"

    @rule(roll=st.integers(0, 4))
    def drain(self, roll):
        """Every request finishes and every task comes back done: nothing may stay in use."""
        if roll:
            return
        for rid in self._live():
            self.cache.release(rid)
        self.reqs.clear()
        self.settle()
        u = self.cache.check()
        assert u["device_used"] == 0 and u["host_used"] == 0, u
        assert u["device_free"] + u["device_cached"] == u["device_total"]

    # ---- invariants ------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        self.cache.check()

    @invariant()
    def pages_hold_their_blocks(self):
        for rid, r in self.reqs.items():
            if r.ready and not r.failed:
                self._check_pages(rid)

    @invariant()
    def held_blocks_stay(self):
        for r in self.reqs.values():
            if not (r.failed or r.stale):
                assert self.cache.lookup(r.keys[:r.held]) == r.held, "a referenced block was evicted"


# 200 examples for each of the four eviction policies below: 800 runs of the same rules over the
# same cache code, where one policy's own part is only which cached block goes first
CacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestPrefixCacheProperties = CacheMachine.TestCase


class ReuseCacheMachine(CacheMachine):
    """The same engine over the `reuse` eviction policy."""

    POLICY = "reuse"


ReuseCacheMachine.TestCase.settings = CacheMachine.TestCase.settings
TestPrefixCacheReuseProperties = ReuseCacheMachine.TestCase


class GapsCacheMachine(CacheMachine):
    """The same engine over the `gaps` eviction policy (the sketch also stamps when each key was
    last used, and the device policy is told the ages of what requests compute)."""

    POLICY = "gaps"


GapsCacheMachine.TestCase.settings = CacheMachine.TestCase.settings
TestPrefixCacheGapsProperties = GapsCacheMachine.TestCase


class AdaptiveCacheMachine(CacheMachine):
    """The same engine over the default `adaptive` eviction policy (the device tier's policy is
    also told what every counted request missed; the host tier's follows its budget)."""

    POLICY = "adaptive"

    @invariant()
    def ledger_in_range(self):
        dev, host = self.cache._dev_lru, self.cache._host_lru
        for q in (dev, host):
            assert 0 <= q.budget() <= q._n
            # (a debt run up under a larger allowance is kept: the floor is the largest one so far)
            assert -max(q.allowance(), q.most) - 1 <= q.bank <= BANK_CAP * q._n
        assert host.budget() == int(dev.share() * host._n)


AdaptiveCacheMachine.TestCase.settings = CacheMachine.TestCase.settings
TestPrefixCacheAdaptiveProperties = AdaptiveCacheMachine.TestCase


class GroupsCacheMachine(CacheMachine):
    """The same engine over a model of several layer groups: one sliding group, a full one
    beside group 0, or two sliding ones (windows in tokens; blocks of 2 tokens)."""

    POLICY = "lru"
    GROUPS = [(3,), (4,), (0, 5), (6, 6), (2,)]


GroupsCacheMachine.TestCase.settings = CacheMachine.TestCase.settings
TestPrefixCacheGroupsProperties = GroupsCacheMachine.TestCase


class AdaptiveGroupsCacheMachine(GroupsCacheMachine):
    """Layer groups over the default eviction policy."""

    POLICY = "adaptive"


AdaptiveGroupsCacheMachine.TestCase.settings = CacheMachine.TestCase.settings
TestPrefixCacheAdaptiveGroupsProperties = AdaptiveGroupsCacheMachine.TestCase
