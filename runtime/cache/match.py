"""Matching and recording: how requests find cached blocks, put new ones in the tree, and
hold references on them.

A request matches the longest cached prefix of its chained block keys (`_walk`: follow each
node's continuation while its key matches, ask the key map where it does not), takes a
reference on every matched node (`_touch`: one vectorised pass when all are on the device, the
common case; host hits get a swap-in task), and records its blocks once their KV is written
(`_record`: a new chain is written into the node matrix with one assignment and costs at most
one key-map insert). A block enters the tree only when its KV is reported written (or read from
storage): nothing unwritten is ever matchable.

References are taken along whole paths and released tail first (`_deref`), so an ancestor is
always more recent than its descendants in the eviction queue and the oldest entry is a leaf.
The tiers are exclusive: a node's KV is on the device or on the host (on both only while a swap
is in flight).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

from kvrt.ipc.protocol import TaskKind

from kvrt.runtime.cache.nodes import (CHILD, CONT, CPU, DETACHED, DEV, GPU, HITS, HOST, NDEV, NEXT, NO_NODES, PARENT, PREV,
                                      REF, ON_DEVICE, ON_HOST, ROOT, STATE, SWAP2CPU, SWAP2GPU, NodeStore)

# the per-request node matrix work, in C (runtime/cache/_cache_core.c; tests/runtime/cache/cache_reference.py holds
# the numpy code it is tested against)
from kvrt.runtime.cache.core import (deref as _deref_c, record_chain as _record_chain_c, touch_device as _touch_c,
                                    walk as _walk_c)

# the node matrix rows a new chain writes, in the order runtime/cache/_cache_core.c's record_chain takes them
CHAIN_ROWS = (PARENT, CHILD, DEV, REF, NDEV, STATE, CONT, NEXT, PREV)
# (a dtype object: numpy looks a type such as np.int32 up anew at every call)
_I32 = np.dtype(np.int32)


@dataclass(slots=True)
class MatchResult:
    """What a request found. `block_ids` is its block table for the matched prefix (device hits,
    swap-in and storage-read destinations, in token order; -1 for the destination of a deferred
    swap-in, see `PrefixCache.block_table`); it may run only once every task in `pending_tasks`
    has been applied as done."""

    block_ids: list[int]
    device_tokens: int = 0
    host_tokens: int = 0
    storage_tokens: int = 0
    pending_tasks: list[int] = field(default_factory=list)

    @property
    def cached_tokens(self) -> int:
        return self.device_tokens + self.host_tokens + self.storage_tokens

    @property
    def ready(self) -> bool:
        return not self.pending_tasks


class Request:
    """The cache's view of one request. `path` (an int32 array, replaced, never modified) holds
    a reference on each node; `blocks` is the block table; `dups` are private blocks at path
    positions whose node holds another copy."""

    __slots__ = ("keys", "num_tokens", "path", "blocks", "dups", "num_matched", "cached_tokens",
                 "waiting", "load", "frozen", "admitted", "loaded", "counted", "host_hits", "storage_hits", "side",
                 "diverged")

    def __init__(self, keys: Sequence[bytes], num_tokens: int, counted: bool):
        self.keys = keys
        self.num_tokens = num_tokens
        self.path: np.ndarray = NO_NODES
        self.blocks: list[int] = []
        self.dups: list[int] = []
        self.num_matched = 0
        self.cached_tokens = 0
        self.waiting: set[int] = set()  # ids of tasks it must wait for
        self.load = -1                  # id of its in-flight storage read, if any
        self.frozen = False             # records nothing more (its path was detached)
        self.admitted = False           # has allocated beyond its match: it is computing
        # its match waited for transfers: they were issued or deferred before every swap-in
        # deferred after them, so its allocation goes ahead of those
        self.loaded = False
        self.counted = counted          # its match is in the hit counters
        self.host_hits = 0              # blocks matched on the host tier / in storage
        self.storage_hits = 0
        self.side: list = []            # its side groups' blocks (runtime/cache/groups.py SideRefs)
        self.diverged = 0               # blocks its keys had cached at match, usable or not (a branch point)


class MatchRecord(NodeStore):
    """Match, record and references, mixed into PrefixCache (swap-ins it starts are tasks of
    runtime/cache/tasks.py; their device blocks come from runtime/cache/eviction.py)."""

    _side_w: list[int]  # side groups' windows, set by PrefixCache (runtime/cache/groups.py); empty: one group

    def _walk(self, keys: Sequence[bytes], limit: int) -> np.ndarray:
        """The tree nodes of keys[:limit]'s longest cached prefix, from the root down: follow
        each node's continuation while its key matches, ask the key map where it does not."""
        path = np.empty(limit, _I32)
        return path[:_walk_c(self._f, CONT, PARENT, self._keys, self._map, keys, limit, path)]

    def _child(self, n: int, key: bytes) -> int:
        """n's child with `key`, or -1."""
        c = self._cont_v[n]
        if c >= 0 and self._keys[c] == key:
            return c
        c = self._map.get(key, -1)
        return c if c >= 0 and self._parent_v[c] == n else -1

    def _touch(self, request_id: Hashable, req: Request, a: np.ndarray, chain: bool = True) -> tuple[int, int]:
        """Take a reference on each matched node (`a`) and make it usable by the request; sets
        the request's path and block table (to `a` and its blocks: a caller that touches side
        nodes too, `chain` False, splits them). Host hits get a swap-in, deferred (block table
        entries -1 until issued) when the device has no free blocks for it yet. Returns
        (device hits, host hits)."""
        f = self._f
        # all on the device (the common case): one call, the blocks as the pool's int objects
        done = _touch_c(f, a, REF, HITS, STATE, DEV, GPU, self.device_pool.ids)
        if done is not None:
            self._dev_lru.discard(a)
            self._idle -= done[0]
            req.path = a
            req.blocks = done[1]
            return len(a), 0
        g = f[DEV:STATE + 1, a]
        refs = g[REF - DEV]
        f[REF, a] = refs + 1
        f[HITS, a] += 1
        self._dev_lru.discard(a)
        st = g[STATE - DEV]
        unused = refs == 0
        self._idle -= int(np.count_nonzero(unused & (st == GPU)))
        self._host_lru.discard(a)  # before eviction below can pick a host hit
        on_host = st == CPU
        ncpu = int(np.count_nonzero(on_host))
        # destinations for the swap-ins; None: deferred until swap-outs return device blocks
        dest = self._take_device(ncpu) if ncpu else []
        if ncpu + int(np.count_nonzero(st == GPU)) == len(a):  # no swap under way: at once
            return self._swap_in_hits(request_id, req, a, a[on_host], dest, chain)
        states = st.tolist()
        path = a.tolist()
        swap_in = []
        dev_hits = host_hits = 0
        for n, s in zip(path, states):
            if s == GPU:
                dev_hits += 1
            elif s == SWAP2CPU:
                self._flip_back(n)
                dev_hits += 1
            elif s == CPU:
                self._start_swap_in(n, dest[len(swap_in)] if dest is not None else -1)
                swap_in.append(n)
                host_hits += 1
            else:  # SWAP2GPU: wait for the swap-in already under way
                task_id = self._task_v[n]
                self._tasks[task_id].waiters.add(request_id)
                req.waiting.add(task_id)
                host_hits += 1
        if swap_in:
            t = self._new_task(TaskKind.SWAP2GPU, swap_in, dest or [],
                               [self._host_v[n] for n in swap_in], issue=dest is not None)
            for n in swap_in:
                self._task_v[n] = t.task.task_id
            if dest is None:
                self._deferred.append(t)
                self._deferred_need += len(swap_in)
            t.waiters.add(request_id)
            req.waiting.add(t.task.task_id)
            self.metrics.swap_in_blocks += len(swap_in)
        req.path = a
        req.blocks = f[DEV, a].tolist()
        return dev_hits, host_hits

    def _swap_in_hits(self, request_id: Hashable, req: Request, a: np.ndarray, swap_in: np.ndarray,
                      dest: list[int] | None, chain: bool = True) -> tuple[int, int]:
        """`_touch` for a path of GPU and CPU nodes only: the CPU ones (`swap_in`, in path order)
        start one swap-in together, as `_start_swap_in` one by one would. On a `chain` each
        node's parent is the node before it, so no parent is counted twice; side nodes of
        several groups share their parents, counted each."""
        f = self._f
        n = len(swap_in)
        if dest is not None:
            f[DEV, swap_in] = dest
            self._dev_cached += n
        f[STATE, swap_in] = SWAP2GPU
        if chain:
            f[NDEV, f[PARENT, swap_in]] += 1
        else:
            np.add.at(f[NDEV], f[PARENT, swap_in], 1)
        t = self._new_task(TaskKind.SWAP2GPU, swap_in.tolist(), dest or [], f[HOST, swap_in].tolist(),
                           issue=dest is not None)
        self._task[swap_in] = t.task.task_id
        if dest is None:
            self._deferred.append(t)
            self._deferred_need += n
        t.waiters.add(request_id)
        req.waiting.add(t.task.task_id)
        self.metrics.swap_in_blocks += n
        req.path = a
        req.blocks = f[DEV, a].tolist()
        return len(a) - n, n

    def _start_swap_in(self, n: int, dev_block: int) -> None:
        if dev_block >= 0:
            self._dev_v[n] = dev_block
            self._dev_cached += 1
        self._state_v[n] = SWAP2GPU
        self._ndev_v[self._parent_v[n]] += 1

    def _flip_back(self, n: int) -> None:
        """A SWAP2CPU node is wanted again: it is GPU at once (its device copy never stopped
        being valid); the host block goes to its task, which frees it when it reports. Until
        then the task still reads the device block, so eviction parks the node."""
        t = self._tasks[self._task_v[n]]
        self._wanted_back[n] = t.task.task_id
        t.orphans.append(self._host_v[n])
        self._host_v[n] = -1
        self._host_cached -= 1
        self._task_v[n] = -1
        self._state_v[n] = GPU
        self._dev_returning -= 1
        self._ndev_v[self._parent_v[n]] += 1
        self.metrics.swap_out_cancelled += 1

    def _count_match(self, req: Request, keys: Sequence[bytes], limit: int, dev_hits: int,
                     host_hits: int, storage_hits: int) -> None:
        m, bs, n = self.metrics, self.block_size, req.num_tokens
        m.requests += 1
        m.query_tokens += n
        m.query_tokens_host += n - dev_hits * bs
        m.query_tokens_storage += n - (dev_hits + host_hits) * bs
        m.hit_tokens_device += dev_hits * bs
        m.hit_tokens_host += host_hits * bs
        m.hit_tokens_storage += storage_hits * bs
        if dev_hits or host_hits or storage_hits:
            m.hit_requests += 1
        matched = len(req.path)
        if matched == limit:
            last = int(req.path[-1]) if matched else ROOT
            if n % bs == 0 and limit < len(keys) and self._child(last, keys[limit]) >= 0:
                m.backoff_tokens += bs
            elif n % bs and limit == n // bs:
                if self._child_v[last] >= 0:
                    m.partial_block_tokens += n % bs

    # ---- recording
    def _record(self, req: Request, n_full: int) -> None:
        """Put the request's blocks [len(path), n_full) into the tree under its path: the usual
        case, none of their keys in the tree yet, is one C call (record_chain: the new chain's
        columns, its link under the parent and the request's new path)."""
        path = req.path
        i0 = len(path)
        out = np.empty(n_full, _I32)
        top = self._top
        k = _record_chain_c(self._f, path, self._stack, top, req.keys, req.blocks, n_full, CHAIN_ROWS, GPU, DETACHED,
                            self._keys, self._map, out)
        if k > 0:
            self._top = top - k
            self._dev_cached += k
            if self._side_w:  # (a recycled id may have been a side node's)
                self._group[out[i0:]] = 0
            if self._obs is not None:
                self._tell_stored(ON_DEVICE, out[i0:].tolist())
            req.path = out
            return
        if k < 0:  # the parent was detached
            req.frozen = True
            return
        # another request computed some of these blocks first: adopt those nodes, create the rest
        k = n_full - i0
        parent = int(path[-1]) if i0 else ROOT
        ids = self._stack[top - k:top].tolist()
        self._top = top - k
        got = self._record_slow(req, parent, ids, req.keys[i0:n_full], req.blocks[i0:n_full], i0)
        req.path = np.concatenate((path, np.array(got, dtype=np.int32)))

    def _record_slow(self, req: Request, parent: int, cand: list[int], keys: list[bytes],
                     blocks: list[int], i0: int) -> list[int]:
        """Some keys were already in the tree (another request computed the same blocks first):
        adopt those nodes, create the rest, give unused node ids back. Returns the nodes.

        Where the node's device copy is readable, the request reads it from now on and its own
        copy is freed: holding both would make a request that fits the device alone need more
        than the device (its copies plus the pinned originals)."""
        got = []
        unused = []
        copies = []
        for j, (key, c, b) in enumerate(zip(keys, cand, blocks)):
            g = self._child(parent, key)
            if g < 0:
                self._new_node(c, key, parent, b)
                g = c
            else:
                unused.append(c)
                if not self._adopt(g, b):
                    if self._state_v[g] == GPU:
                        req.blocks[i0 + j] = self._dev_v[g]
                        copies.append(b)
                    else:  # still being swapped in: the request keeps reading its own copy
                        req.dups.append(b)
            got.append(g)
            parent = g
        self._push_ids(unused)
        self.device_pool.free(copies)
        return got

    def _new_node(self, n: int, key: bytes, parent: int, dev_block: int) -> None:
        self._group[n] = 0
        self._keys[n] = key
        self._dev_v[n] = dev_block
        self._ref_v[n] = 1
        self._state_v[n] = GPU
        self._link(n, key, parent)
        self._ndev_v[parent] += 1
        self._dev_cached += 1
        if self._obs is not None:
            self._tell_stored(ON_DEVICE, (n,))

    def _adopt(self, n: int, dev_block: int) -> bool:
        """Reference an existing node for a block the request computed itself. A host-only node
        takes the request's fresh device copy (True: the block now belongs to the node);
        otherwise the request keeps its copy privately (False)."""
        s = self._state_v[n]
        refs = self._ref_v[n]
        self._ref_v[n] = refs + 1
        if s == GPU:
            self._idle -= refs == 0
            self._dev_lru.discard_one(n)
        elif s == SWAP2CPU:
            self._flip_back(n)
        elif s == CPU:
            self._host_lru.discard_one(n)
            self.host_pool.free([self._host_v[n]])
            self._host_v[n] = -1
            self._host_cached -= 1
            self._dev_v[n] = dev_block
            self._dev_cached += 1
            self._state_v[n] = GPU
            self._ndev_v[self._parent_v[n]] += 1
            if self._obs is not None:
                self._tell_moved(n, ON_HOST, ON_DEVICE)
            return True
        return False

    # ---- references
    def _deref(self, path: np.ndarray, front: bool = False) -> None:
        """Drop one reference along `path`; nodes left unreferenced become evictable, tail first
        so that a chain's deepest block is evicted first. `front`: leaves (side nodes,
        runtime/cache/groups.py) that are to be evicted before anything queued, in order."""
        if not len(path):
            return
        f = self._f
        zero = np.empty(len(path), _I32)
        k, all_gpu = _deref_c(f, path, REF, STATE, GPU, zero)
        zero = zero[:k]
        if not k:
            return
        st = None if all_gpu else f[STATE, zero]
        if st is None or not st.any():
            if front:
                self._dev_lru.push_front_run(zero.tolist())
            else:
                self._dev_lru.push(zero)
            self._idle += len(zero)
            return
        on_device = zero[st == GPU]
        if front:
            self._dev_lru.push_front_run(on_device.tolist())
        else:
            self._dev_lru.push(on_device)
        self._idle += len(on_device)
        devs: list[int] = []
        hosts: list[int] = []
        for n in zero[st == DETACHED].tolist():
            if self._task_v[n] < 0:
                self._free_node(n, devs, hosts)
        # SWAP2CPU / SWAP2GPU: their task's result queues them
        self.device_pool.free(devs)
        self.host_pool.free(hosts)

