"""The prefix cache: a tree of KV blocks over the device and host tiers, driven by the engine.

What it does: full blocks of a request become tree nodes keyed by their chained block key; a
new request matches the longest cached prefix (device hits, host hits that need a swap-in, then
a storage lookup), allocates the rest with eviction, records blocks as their KV is written, and
releases everything when it finishes. Swaps and storage transfers are tasks the engine hands to
the cache-transfer ranks; their results come back through `apply_task_result`. All of it is
in-process and single-threaded: ordering by messages replaces a lock.

`PrefixCache` is the facade the engine and scheduler use; each idea behind it has its own file:
- runtime/cache/nodes.py: the node store (every node a column of one int32 matrix), tree surgery;
- runtime/cache/match.py: matching, recording and references;
- runtime/cache/eviction.py: device allocation and eviction, in the order of an eviction policy
  (runtime/cache/policies/base.py: the interface and the names; policies/gaps.py: age, reuse and
  reuse gap, a node's default; policies/reuse.py: age and reuse, both with
  runtime/cache/use_sketch.py; policies/lru.py: LRU over leaves, `PrefixCache`'s own default);
- runtime/cache/tasks.py: transfer-task bookkeeping (swaps, deferred swap-ins, storage);
- runtime/cache/reset.py: the reset (every block nothing holds freed, nothing matched after);
- runtime/cache/check.py: the invariant checker.
They are mixins of one object rather than objects calling each other: the per-block loops
(match walk, touch, release, eviction) read the node matrix directly, with no call layer per
block, which is what keeps the cache fast at a million blocks.
"""
from __future__ import annotations

import logging
from typing import Callable, Hashable, Sequence

import numpy as np

from kvrt.ipc.protocol import TaskKind, TransferTask

from kvrt.runtime.cache.check import Checker
from kvrt.runtime.cache.core import give_uses as _give_uses_c
from kvrt.runtime.cache.eviction import Eviction
from kvrt.runtime.cache.groups import SideGroups
from kvrt.runtime.cache.match import MatchResult, Request
from kvrt.runtime.cache.metrics import CacheMetrics
from kvrt.runtime.cache.pool import BlockPool
from kvrt.runtime.cache.nodes import (CPU, DETACHED, DEV, FREE, GPU, HITS, HOST, NO_NODES, ON_DEVICE, ON_HOST, PARENT,
                                      ROOT, STATE, SWAP2CPU, SWAP2GPU, NodeStore)
from kvrt.runtime.cache.events import CacheObserver, CachedBlock
from kvrt.runtime.cache.policies.base import EvictionPolicy
from kvrt.runtime.cache.policies.lru import EvictionQueue
from kvrt.runtime.cache.reset import CacheReset, ResetResult
from kvrt.runtime.cache.tasks import TaskBook, TaskOutcome
from kvrt.runtime.cache.use_sketch import UseSketch

__all__ = ["PrefixCache", "MatchResult", "ResetResult", "TaskKind", "TaskOutcome", "ROLE_FREE", "ROLE_TREE", "ROLE_PRIVATE",
           "ROLE_LOADING", "ROLE_SAVING"]

log = logging.getLogger(__name__)

# block roles (PrefixCache.block_roles): free, in the tree (readable, immutable), private to a
# request (its worker computes into it), being written by a task, being read by a task
ROLE_FREE, ROLE_TREE, ROLE_PRIVATE, ROLE_LOADING, ROLE_SAVING = range(5)

StorageLookup = Callable[[Sequence[bytes]], int]
_NO_AGES = np.empty(0, dtype=np.int64)


class PrefixCache(SideGroups, TaskBook, Eviction, CacheReset):
    """The engine's prefix cache over `num_device_blocks` device and `num_host_blocks` host
    blocks of `block_size` tokens.

    `storage_lookup(keys)`, if given, returns how many leading keys the storage tier holds;
    matching asks it for the blocks the tree lacks and reads hits with a STORAGE2GPU task.
    `storage_known(keys)` (default: `storage_lookup`) says how many leading keys are known to be
    stored, so write-through skips them (a shared store's lookup answers "maybe", not "known").
    `write_through` writes the blocks a request computed to storage when it is released.
    `policy` makes each tier's eviction queue (runtime/cache/policies/base.py).
    `low_water` (with a host tier): device blocks kept free or on their way back by swapping
    out ahead of need (default 1/64 of the device).
    `observer` (runtime/cache/events.py) is told of every block a node gains or loses on a tier:
    stored once readable (recorded, swapped in or out), removed when it leaves.
    `groups`: the windows in tokens (0: full attention) of a model's layer groups after the
    first (ipc/layout.py LayerGroups.side_windows): a block of tokens then takes a page per group
    and the other groups' pages are side nodes (runtime/cache/groups.py); block counts are pages.
    """

    def __init__(self, block_size: int, num_device_blocks: int, num_host_blocks: int = 0, *,
                 storage_lookup: StorageLookup | None = None, write_through: bool = False,
                 policy: type[EvictionPolicy] = EvictionQueue, low_water: int | None = None,
                 storage_known: StorageLookup | None = None, observer: CacheObserver | None = None,
                 groups: Sequence[int] = ()):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.device_pool = BlockPool("device", num_device_blocks)
        self.host_pool = BlockPool("host", num_host_blocks)
        self.storage_lookup = storage_lookup
        self.storage_known = storage_known or storage_lookup
        self.write_through = write_through
        self.metrics = CacheMetrics()
        # a live node holds at least one block
        NodeStore.__init__(self, num_device_blocks + num_host_blocks + 1, policy)
        TaskBook.__init__(self)
        self._reqs: dict[Hashable, Request] = {}
        self._obs = observer
        if any(w < 0 for w in groups):
            raise ValueError(f"layer group windows must be >= 0 tokens, got {list(groups)}")
        self._side_w = list(groups)
        # use counts that outlive eviction, for a policy that ranks by them
        self._uses = UseSketch(len(self._keys), timed=policy.counts_gaps) if policy.counts_uses else None
        # per counted request of a gap-counting policy: how long ago each of its keys was used
        # before (the sketch's answer at match), handed to the policy as its blocks are recorded
        self._ages: dict[Hashable, np.ndarray] = {}
        self._low_water = max(1, num_device_blocks // 64) if low_water is None else low_water
        # a policy that remembers the blocks gone from the cache itself: per counted request, the
        # matched length and what it recalled of the keys after it (releases since each was last
        # used, uses), until its blocks are recorded; one that judges itself by the blocks
        # requests miss is told them (device tier), and the host tier's queue follows the device's
        self._remembers = policy.remembers
        self._recalled: dict[Hashable, tuple[int, np.ndarray, np.ndarray]] = {}
        self._sees_misses = policy.sees_misses
        self._host_lru.follows(self._dev_lru)

    # ---- engine-facing API -------------------------------------------------------------------
    def match(self, request_id: Hashable, keys: Sequence[bytes], num_tokens: int,
              count: bool = True, storage: bool = True) -> MatchResult:
        """Start a request of `num_tokens` tokens whose full blocks have `keys`, and match its
        cached prefix. At least the last token is always left to compute (its logits are needed),
        so a prompt that matches entirely gives its last block back.

        `keys` must be chained (each key hashes its parent's key, as runtime/cache/keys.py makes
        them): a key is found only under the node of the key before it. `count=False` keeps the
        match out of the hit counters: a request matched again after preemption or after a
        failed allocation is still one request. `storage=False` matches the tree only: the
        request read storage already and has not run since (see Scheduler._match). If anything
        raises, the request is undone."""
        if request_id in self._reqs:
            raise ValueError(f"request {request_id!r} is already in the prefix cache")
        if num_tokens <= 0:
            raise ValueError(f"request {request_id!r}: num_tokens must be positive, got {num_tokens}")
        try:
            return self._match(request_id, keys, num_tokens, count, storage)
        except BaseException:
            if request_id in self._reqs:
                self.release(request_id)
            raise

    def _match(self, request_id: Hashable, keys: Sequence[bytes], num_tokens: int,
               count: bool, storage: bool) -> MatchResult:
        bs = self.block_size
        req = Request(keys, num_tokens, counted=count)
        self._reqs[request_id] = req
        limit = min(len(keys), (num_tokens - 1) // bs)
        path = self._walk(keys, limit)
        matched = len(path)
        dev_hits = host_hits = 0
        if self._side_w:
            req.diverged = matched
            matched, found = self._viable(keys, path)
            path = path[:matched]
            dev_hits, host_hits = self._touch_groups(request_id, req, path, self._side_hit(req, matched, found))
        elif matched:
            dev_hits, host_hits = self._touch(request_id, req, path)
        req.num_matched = matched
        if count and self._uses is not None:
            ages = self._uses.add(keys)
            if ages is not None:
                self._ages[request_id] = ages
        elif count and self._remembers:
            got = self._dev_lru.recall(keys, matched)
            if got is not None:
                self._recalled[request_id] = (matched, *got)
            if self._sees_misses:
                self._dev_lru.missed(got[0][:max(0, limit - matched)] if got is not None else _NO_AGES, limit)
        storage_hits = 0
        # (a model of several layer groups reads on from where its walk ended only: blocks
        # between a hit and the walk's end are in the tree already, without their window)
        if storage and self.storage_lookup is not None and matched < limit and \
                (not self._side_w or matched == req.diverged):
            storage_hits = self._read_storage(request_id, req, keys[matched:limit])
        req.cached_tokens = len(req.path) * bs
        req.host_hits, req.storage_hits = host_hits, storage_hits
        req.loaded = bool(req.waiting)
        if count:
            self._count_match(req, keys, limit, dev_hits, host_hits, storage_hits)
        return MatchResult(list(req.blocks), dev_hits * bs, host_hits * bs, storage_hits * bs,
                           sorted(req.waiting) if req.waiting else [])

    def _touch_groups(self, request_id: Hashable, req: Request, path: np.ndarray, side: np.ndarray) -> tuple[int, int]:
        """`_touch` of group 0's path and the side nodes of the hit together (one reference
        pass: a swap-in's eviction cannot take a node found but not yet referenced). Returns
        group 0's (device hits, host hits): a hit counts tokens, whatever pages they need."""
        st = self._f[STATE, path]
        host = int(np.count_nonzero((st == CPU) | (st == SWAP2GPU)))
        if not len(path) and not len(side):
            return 0, 0
        a = np.concatenate((path, side)) if len(side) else path
        self._touch(request_id, req, a, chain=False)
        n = len(path)
        req.path = a[:n]
        self._side_blocks(req, req.blocks[n:])
        req.blocks = req.blocks[:n]
        return n - host, host

    def allocate(self, request_id: Hashable, num_tokens: int, reads_from: int = 0) -> list[int] | None:
        """Grow the request's block table to hold `num_tokens` tokens (prompt and any decode
        room); returns the new block ids, or None when the device cannot supply them now.

        None changes nothing when free and evictable blocks could not cover the request anyway
        (no flush of the cache for an allocation that fails regardless); when they could, it
        starts the evictions (swap-outs to the host tier finish later) and the retry after
        their results succeeds. The first allocation of a request queues behind deferred
        swap-ins (arrival order); a request already computing grows ahead of them, so a
        swap-in never waits for blocks the request it would block holds, and neither does a
        request whose own transfers were in line before theirs.

        `reads_from`: the first position the request computes from (a decode node's request
        whose prompt KV comes from a prefill node): a sliding layer group gets no page for a
        block its window will never read again from there (runtime/cache/groups.py)."""
        req = self._request(request_id)
        need = -(-num_tokens // self.block_size) - len(req.blocks)
        if need <= 0:
            return []
        if req.dups:
            self._drop_dups(req)
        side = self._side_need(req, need, reads_from) if self._side_w else []
        got = self._take_device(need + sum(side) if side else need, urgent=req.admitted or req.loaded)
        if got is not None:
            if side:
                self._side_grow(req, need, got[need:], side)
                got = got[:need]
                if reads_from:
                    self._slide(req, reads_from)
            req.blocks += got
            req.admitted = True
            self._swap_ahead()
        return got

    def _drop_dups(self, req: Request) -> None:
        """The request's private copies of blocks whose node was still being swapped in when it
        recorded them: once the swap-in is done it reads the node's copy and its own is freed.
        Holding both would make a request that fits the device alone need more than the device,
        and it could then never grow. Done here because allocation happens between steps only,
        when no step reads the private copy."""
        dups = set(req.dups)
        freed = []
        for i, n in enumerate(req.path.tolist()):
            b = req.blocks[i]
            if b in dups and self._state_v[n] == GPU:
                req.blocks[i] = self._dev_v[n]
                freed.append(b)
        if freed:
            gone = set(freed)
            req.dups = [b for b in req.dups if b not in gone]
            self.device_pool.free(freed)

    def reclaimable(self, request_id: Hashable, num_tokens: int) -> bool:
        """Could `allocate(request_id, num_tokens)` succeed once in-flight tasks finish,
        without any other request giving up blocks? (Free blocks, blocks swap-outs are
        returning and unreferenced cached blocks cover it.) The scheduler waits then instead
        of preempting."""
        req = self._request(request_id)
        need = (-(-num_tokens // self.block_size) - len(req.blocks)) * (1 + len(self._side_w))
        if not (req.admitted or req.loaded):
            need += self._deferred_need
        return need <= self.device_pool.num_free + self._dev_returning + self._idle - self._idle_above_deferred()

    def _idle_above_deferred(self) -> int:
        """Idle device nodes no eviction can take while swap-ins wait for room: the ancestors
        of a deferred swap-in's nodes (a node with a child on its way to the device is not a
        leaf). Counting them as room would make a request wait for blocks that only the
        deferred swap-in, itself waiting for room, could free: a stall."""
        seen: set[int] = set()
        parked = 0
        for t in self._deferred:
            for n in t.nodes:
                p = self._parent_v[n]
                while p > ROOT and p not in seen:
                    seen.add(p)
                    parked += self._state_v[p] == GPU and self._ref_v[p] == 0
                    p = self._parent_v[p]
        return parked

    def waits_for_room(self, request_id: Hashable) -> bool:
        """Does the request wait for a deferred swap-in (one that has no device blocks yet)?
        Such a request only holds blocks; one whose transfers are under way will be ready."""
        waiting = self._request(request_id).waiting
        return bool(waiting) and any(t.task.task_id in waiting for t in self._deferred)

    @property
    def stalled_swap_ins(self) -> bool:
        """The oldest deferred swap-in cannot get room from free, returning or evictable
        blocks: only a request giving up blocks can make it (the scheduler then preempts a
        loading request). Younger ones wait their turn, served as the oldest are."""
        return bool(self._deferred) and not self._dev_returning and (
            len(self._deferred[0].nodes) > self.device_pool.num_free + self._idle - self._idle_above_deferred())

    @property
    def swap_ins_wait(self) -> bool:
        """Some swap-in waits for device blocks (deferred)."""
        return bool(self._deferred)

    def waits_first(self, request_id: Hashable) -> bool:
        """Does the request wait for the oldest deferred swap-in, the next one to get room?"""
        return bool(self._deferred) and self._deferred[0].task.task_id in self._request(request_id).waiting

    def device_blocks_held(self, request_id: Hashable) -> int:
        """Device blocks in the request's table (cached ones it references and its own), every
        layer group's pages counted."""
        req = self._request(request_id)
        return sum(b >= 0 for b in req.blocks) + (self._side_held_pages(req) if req.side else 0)

    def update(self, request_id: Hashable, num_computed_tokens: int,
               keys: Sequence[bytes] | None = None) -> int:
        """Record that the KV of the request's first `num_computed_tokens` tokens is written:
        its full blocks up to there become matchable. `keys` replaces the request's key list
        when the request grew. Returns the tokens of the request now covered by the tree."""
        req = self._request(request_id)
        if keys is not None:
            req.keys = keys
        if req.waiting:
            raise RuntimeError(f"request {request_id!r} still waits for tasks {sorted(req.waiting)}")
        if num_computed_tokens > len(req.blocks) * self.block_size:
            raise ValueError(f"request {request_id!r}: {num_computed_tokens} tokens computed but "
                             f"only {len(req.blocks)} blocks allocated")
        n_full = min(num_computed_tokens // self.block_size, len(req.keys))
        if n_full > len(req.path) and not req.frozen:
            before = len(req.path)
            self._record(req, n_full)
            if self._uses is not None:
                self._remember_uses(req, before, self._ages.get(request_id))
            elif self._remembers and request_id in self._recalled:
                self._give_recalled(req, before, self._recalled[request_id])
            if req.side and not req.frozen:
                self._record_sides(req, before)
        if req.side:
            self._slide(req, num_computed_tokens)
        return len(req.path) * self.block_size

    def _give_recalled(self, req: Request, before: int, recalled: tuple[int, np.ndarray, np.ndarray]) -> None:
        """Give the nodes just recorded for `req` (path[before:]) the uses the policy recalled for
        their keys, never more than their parent's (every request that used a block used its
        prefix), and tell it how long ago each was used."""
        nodes = req.path[before:]
        matched, ages, uses = recalled
        lo = before - matched
        if not len(nodes) or lo < 0:
            return
        # the uses, capped and a running minimum, in one C call (a dozen numpy calls per request)
        cap = self._hits_v[req.path[before - 1]] if before else 0
        _give_uses_c(self._f, HITS, nodes, uses, lo, before > 0, cap)
        got_ages = ages[lo:lo + len(nodes)]
        if len(got_ages) < len(nodes):  # (keys the request grew by after its match: not recalled)
            got_ages = np.concatenate((got_ages, np.full(len(nodes) - len(got_ages), -1, dtype=np.int64)))
        self._dev_lru.recorded(nodes, got_ages)

    def _remember_uses(self, req: Request, before: int, ages: np.ndarray | None = None) -> None:
        """Give the nodes just recorded for `req` (path[before:]) the uses their keys had before
        (the sketch counted this request too), never more than their parent's: every request
        that used a block used its prefix. With `ages` (the request's keys' last uses, for a
        gap-counting policy), tell the device policy how long ago each node's key was used."""
        nodes = req.path[before:]
        if not len(nodes):
            return
        keys = req.keys[before:before + len(nodes)]
        cap = self._hits_v[int(req.path[before - 1])] if before else None
        self._uses.raise_hits(keys, self._f[HITS], nodes, cap)
        if ages is not None:
            got = ages[before:before + len(nodes)]
            if len(got) < len(nodes):  # keys the request grew by after its match: not counted
                got = np.concatenate((got, np.full(len(nodes) - len(got), -1, dtype=np.int64)))
            self._dev_lru.recorded(nodes, got)

    def release(self, request_id: Hashable) -> None:
        """Finish a request: free its private blocks (partial last block, decode blocks, copies of
        blocks another request recorded first) and drop its references."""
        req = self._reqs.pop(request_id, None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not in the prefix cache")
        self._ages.pop(request_id, None)
        self._recalled.pop(request_id, None)
        n = len(req.path)
        private = req.blocks[n:]
        if req.load >= 0:  # a storage read still writes into the next blocks: the task keeps them
            load = self._tasks[req.load]
            load.request = None
            private = req.blocks[n + load.primary:]
            if req.side:
                self._side_forget(req, load.task.device_blocks)
        unwanted = []
        for task_id in req.waiting:
            t = self._tasks[task_id]
            t.waiters.discard(request_id)
            if not t.waiters and t in self._deferred:
                unwanted.append(t)
        private += req.dups
        self.device_pool.free(private)
        side = self._side_release(req) if req.side else NO_NODES
        if self.write_through and n > req.num_matched:
            self._write_back(req, side)
        else:
            self._deref(side)
            self._deref(req.path)
        for t in unwanted:  # (a request that adopted one of its nodes still holds it: keep it)
            if not any(self._ref_v[n] for n in t.nodes):
                self._cancel_deferred(t)
        self._pump_deferred()

    def block_table(self, request_id: Hashable) -> list[int]:
        """The request's device block ids in token order (final once the request is ready)."""
        return list(self._request(request_id).blocks)

    def is_ready(self, request_id: Hashable) -> bool:
        """True once no task the request waits for is in flight."""
        return not self._request(request_id).waiting

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the tree holds (any tier); no side effects."""
        return len(self._walk(keys, len(keys)))

    def take_tasks(self) -> list[TransferTask]:
        """Tasks created since the last call; the engine sends each to every cache-transfer rank."""
        return self._take_tasks()

    def apply_task_result(self, task_id: int, ok: bool, blocks: int | None = None) -> TaskOutcome:
        """Apply a finished task. For STORAGE2GPU, `blocks` is how many leading blocks were read
        (default: all if ok, none if not); other kinds are all or nothing."""
        return self._apply(task_id, ok, blocks)

    def reset(self) -> ResetResult:
        """Drop the whole cache, as operators ask (vLLM's `POST /reset_prefix_cache`, SGLang's
        `/flush_cache`): every cached block no request or task holds is freed now, on both
        tiers; held ones leave the tree and are freed when released. Nothing cached before is
        matched after; requests in flight finish as they would have, recording nothing more.
        The observer is told `cleared()` (see runtime/cache/reset.py)."""
        return self._reset()

    # ---- status --------------------------------------------------------------------------------
    def block_usage(self) -> dict[str, int]:
        """free / cached (held by tree nodes) / used (requests and tasks) / total, per tier."""
        out = {}
        for tier, pool, cached in (("device", self.device_pool, self._dev_cached),
                                   ("host", self.host_pool, self._host_cached)):
            out[f"{tier}_total"] = pool.num_blocks
            out[f"{tier}_free"] = pool.num_free
            out[f"{tier}_cached"] = cached
            out[f"{tier}_used"] = pool.num_blocks - pool.num_free - cached
        return out

    def block_roles(self) -> tuple[np.ndarray, np.ndarray]:
        """What every device and host block is for, as int8 arrays of ROLE_* codes: the truth
        the ownership race detector (KVRT_CHECK_OWNERSHIP=1) syncs its shared owner table from.

        Tasks not yet taken by the engine count as not started (their sources are still tree
        blocks, their destinations still free), so the engine can sync, then hand each new
        task's blocks over and have the hand-over check where they come from. O(blocks):
        debug mode only."""
        dev = np.full(self.device_pool.num_blocks, ROLE_PRIVATE, dtype=np.int8)
        host = np.full(self.host_pool.num_blocks, ROLE_PRIVATE, dtype=np.int8)
        for roles, row in ((dev, self._f[DEV]), (host, self._f[HOST])):
            live = (self._f[STATE] != FREE) & (self._f[STATE] != DETACHED) & (row >= 0)
            roles[row[live]] = ROLE_TREE
        dev[self.device_pool.free_blocks()] = ROLE_FREE
        host[self.host_pool.free_blocks()] = ROLE_FREE
        for t in self._tasks.values():
            reads, writes = t.task.kind.reads, t.task.kind.writes
            sides = {"device": (dev, t.task.device_blocks), "host": (host, t.task.host_blocks)}
            if t.issued and reads in sides:
                roles, blocks = sides[reads]
                roles[[b for b in blocks if b >= 0]] = ROLE_SAVING
            if writes in sides:
                roles, blocks = sides[writes]
                roles[[b for b in blocks if b >= 0]] = ROLE_LOADING if t.issued else ROLE_FREE
        return dev, host

    def observe(self, observer: CacheObserver | None) -> None:
        """Tell `observer` (None: nobody) of every block gained or lost from now on."""
        self._obs = observer

    def cached_blocks(self) -> list[CachedBlock]:
        """Every readable block the tree holds, per tier, as the observer was told of them (a
        KV events snapshot). O(blocks)."""
        state, parent, keys, group = self._f[STATE], self._f[PARENT], self._keys, self._group
        windows = [0] + self._side_w
        out = []
        for medium, live in ((ON_DEVICE, (state == GPU) | (state == SWAP2CPU)),
                             (ON_HOST, (state == CPU) | (state == SWAP2GPU))):
            live[0] = False  # the root holds no block
            for n in np.flatnonzero(live).tolist():
                g = int(group[n])
                out.append(CachedBlock(keys[n], keys[parent[n]], medium, g, windows[g]))
        return out

    def snapshot(self) -> dict[str, float]:
        """Counters, rates and block usage as one flat dict (for status and Prometheus)."""
        out = self.metrics.snapshot()
        out.update(self.block_usage())
        out["nodes"] = int((self._f[STATE] <= SWAP2GPU).sum()) - 1  # in the tree, root aside
        out["requests_active"] = len(self._reqs)
        out["tasks_inflight"] = len(self._tasks)
        return out

    def _request(self, request_id: Hashable) -> Request:
        try:
            return self._reqs[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not in the prefix cache") from None

    # ---- invariants ----------------------------------------------------------------------------
    def check(self) -> dict[str, int]:
        """Assert the cache's invariants (O(blocks); for tests and debug runs): per tier every
        block is exactly one of free, cached (held by a node) or in use (a request's private
        block, a task's), and free + cached + used = total; the tree, its key map, reference
        counts and LRU lists agree. Returns block_usage()."""
        Checker(self).run()
        return self.block_usage()


