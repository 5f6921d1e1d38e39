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
- once every request is released and every task applied, every block is free or cached.
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvrt.runtime.cache.keys import BlockHasher
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

    @initialize(device=st.integers(4, 24), host=st.sampled_from([0, 0, 3, 8, 16]),
                storage=st.booleans(), write_through=st.booleans())
    def setup(self, device, host, storage, write_through):
        # the storage tier starts with one prefix some earlier node wrote
        self.stored: set[bytes] = set(BlockHasher(BS).update(BASES[2][:30])) if storage else set()
        self.cache = PrefixCache(BS, device, host,
                                 storage_lookup=self._storage_lookup if storage else None,
                                 write_through=write_through and storage, policy=make_policy(self.POLICY))
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
        self.reqs[rid] = r
        return rid

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

    def _apply(self, task, ok: bool, read: int | None) -> None:
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
            assert -q.allowance() - 1 <= q.bank <= BANK_CAP * q._n
        assert host.budget() == int(dev.share() * host._n)


AdaptiveCacheMachine.TestCase.settings = CacheMachine.TestCase.settings
TestPrefixCacheAdaptiveProperties = AdaptiveCacheMachine.TestCase
