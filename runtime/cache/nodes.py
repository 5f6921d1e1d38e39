"""The prefix cache's node store: every tree node is a column of one int32 matrix.

Why a matrix and not one Python object per node: at a million cached blocks per-node objects,
dicts and lists make the garbage collector a large share of the run time; an int matrix holds
no references for the collector to walk, a request's path is touched or released with a few
vectorised numpy operations, a new chain of blocks is written with one, and single fields are
read and written through memoryviews of the rows (as fast as list items). Node ids are recycled
from a stack; freeing a node resets every field, so a reused id carries nothing stale (the
checker, runtime/cache/check.py, verifies).

Children are found by key without a children map per node. A key already chains its parent's
key, so one dict (key -> node id) for the whole tree would do; but at a million keys every dict
insert costs ~500 ns of cache misses (measured), more than all other per-block work. So each
node has at most one "continuation" child (CONT: the next block of the chain it was recorded
with) that is found by comparing its key, and only the other children (branch points, and
chains started under a node that already has a continuation) are in the dict. Children are also
intrusive sibling links (first child, next, prev), to unlink a node in O(1) and to walk a
subtree that must be dropped.

The store also keeps what every structural change must keep in step: the per-tier counts of
cached blocks and the two eviction queues (the device one holds unreferenced GPU leaves, the
host one CPU leaves; see runtime/cache/policies/base.py for the policy interface).
"""
from __future__ import annotations

import enum
from typing import Sequence

import numpy as np

from kvrt.runtime.cache.events import CPU as ON_HOST, GPU as ON_DEVICE, CacheObserver
from kvrt.runtime.cache.policies.base import EvictionPolicy


class NodeState(enum.IntEnum):
    GPU = 0        # on the device, readable
    SWAP2CPU = 1   # being copied to a host block; the device copy stays readable until done
    CPU = 2        # on the host only
    SWAP2GPU = 3   # being copied into a device block; unusable until the swap reports done
    DETACHED = 4   # dropped from the tree while still held: kept until its refs and task drain
    FREE = 5       # node id not in use


GPU, SWAP2CPU, CPU, SWAP2GPU, DETACHED, FREE = (int(s) for s in NodeState)
ROOT = 0  # node 0 is the root: no key, no block, pinned by a permanent reference

# rows of the node matrix (HITS: how many matches reused the node since it was created;
# eviction policies may read it)
PARENT, CHILD, DEV, REF, NDEV, STATE, CONT, NEXT, PREV, HOST, HITS = range(11)
# a free node's column: no links, no blocks, no references, no device children, FREE, no hits
RESET = np.array([-1, -1, -1, 0, 0, FREE, -1, -1, -1, -1, 0], dtype=np.int32)
NO_NODES = np.empty(0, dtype=np.int32)
NO_NODES.flags.writeable = False


class NodeStore:
    """The node matrix of `n` node ids (root included), its key map, free-id stack, per-tier
    cached-block counts and eviction queues (`policy(n, hits)` makes each, `hits` being the
    matrix row of reuse counts), and tree surgery: linking,
    unlinking, detaching and freeing nodes."""

    _obs: CacheObserver | None = None  # told of every block a node gains or loses (KV events)
    # the task bookkeeping's (runtime/cache/tasks.py), which freeing a node consults: nodes
    # matched back while a swap-out copies them -> that swap-out, and the tasks by id
    _wanted_back: dict[int, int]
    _tasks: dict
    # device victims the policy has handed out that eviction has yet to drop (runtime/cache/
    # eviction.py `_drop_one_by_one`): still queued, as far as one-at-a-time eviction goes
    _handed_out: frozenset[int] | set[int] = frozenset()

    def __init__(self, n: int, policy: type[EvictionPolicy]):
        self._f = np.repeat(RESET[:, None], n, axis=1)  # the node matrix: a row per field
        row = [memoryview(r) for r in self._f]
        self._parent_v, self._child_v, self._dev_v, self._ref_v = row[PARENT], row[CHILD], row[DEV], row[REF]
        self._ndev_v = row[NDEV]    # children in GPU or SWAP2GPU
        self._state_v = row[STATE]
        self._cont_v = row[CONT]    # the continuation child, found by key compare, not in _map
        self._next_v, self._prev_v = row[NEXT], row[PREV]  # siblings; CHILD is the first child
        self._host_v = row[HOST]
        self._hits_v = row[HITS]
        self._task = np.full(n, -1, dtype=np.int64)  # the in-flight task moving the node
        self._task_v = memoryview(self._task)
        self._keys: list[bytes | None] = [None] * n
        self._stack = np.arange(n - 1, 0, -1, dtype=np.int32)   # free node ids; top at the end
        self._stack_v = memoryview(self._stack)
        self._top = n - 1
        self._state_v[ROOT] = GPU
        self._ref_v[ROOT] = 1
        self._map: dict[bytes, int] = {}  # key -> node, for nodes that are not continuations
        self._pos_scratch = np.full(n, -1, dtype=np.int32)  # node -> index in a run; -1 between uses
        self._dev_lru = policy(n, self._f[HITS])   # unreferenced GPU leaves
        self._host_lru = policy(n, self._f[HITS])  # CPU leaves
        self._dev_cached = 0     # blocks held by nodes, per tier
        self._host_cached = 0
        self._idle = 0           # unreferenced GPU nodes: what eviction can still free
        # node -> its layer group (runtime/cache/groups.py); all 0 unless the model has side groups,
        # where every node a request creates sets it
        self._group = np.zeros(n, dtype=np.int16)

    def _link(self, n: int, key: bytes, parent: int, side: bool = False) -> None:
        """Make n (with `key`) the first child of parent, and its continuation if it has none
        and n is not a side node (runtime/cache/groups.py); otherwise n is found through the
        key map."""
        if self._cont_v[parent] < 0 and not side:
            self._cont_v[parent] = n
        else:
            self._map[key] = n
        head = self._child_v[parent]
        self._parent_v[n] = parent
        self._prev_v[n] = -1
        self._next_v[n] = head
        if head >= 0:
            self._prev_v[head] = n
        self._child_v[parent] = n

    def _unlink(self, n: int) -> None:
        """Take n out of its parent's children and out of the key map, updating the parent's
        leaf status."""
        p = self._parent_v[n]
        if self._cont_v[p] != n:
            del self._map[self._keys[n]]
        self._detach_sibling(n)
        if self._state_v[n] in (GPU, SWAP2GPU):
            self._device_child_gone(p)
        if self._child_v[p] < 0:
            self._host_leaf_again(p)

    def _detach_sibling(self, n: int) -> int:
        """Take n out of its parent's child list (and continuation); the parent. Nothing else:
        the key map and the parent's leaf status are the caller's (batched paths do them once)."""
        p, before, after = self._parent_v[n], self._prev_v[n], self._next_v[n]
        if self._cont_v[p] == n:
            self._cont_v[p] = -1
        if before >= 0:
            self._next_v[before] = after
        else:
            self._child_v[p] = after
        if after >= 0:
            self._prev_v[after] = before
        return p

    def _host_leaf_again(self, p: int) -> None:
        """p's last child left; an unreferenced CPU node is now an evictable host leaf. (A CPU
        node is referenced only inside `match`, between being matched and its swap-in starting.)"""
        if self._state_v[p] == CPU and self._ref_v[p] == 0 and p not in self._host_lru:
            self._host_lru.push_front(p)

    def _drop_subtree(self, v: int, devs: list[int], hosts: list[int]) -> None:
        """Remove v and everything below it from the tree. Unreferenced nodes with no task in
        flight are freed (their blocks appended to devs / hosts); the others are DETACHED: they
        keep their blocks until their references and task drain."""
        self._unlink(v)
        if self._child_v[v] < 0 and self._ref_v[v] == 0 and self._task_v[v] < 0:  # a leaf: usual
            self._free_node(v, devs, hosts)
            return
        nodes = []
        stack = [v]
        while stack:  # collect first: freeing a node resets the links its children are found by
            n = stack.pop()
            nodes.append(n)
            c = self._child_v[n]
            while c >= 0:
                if self._cont_v[n] != c:
                    del self._map[self._keys[c]]
                stack.append(c)
                c = self._next_v[c]
        for n in nodes:
            if self._ref_v[n] == 0 and self._task_v[n] < 0:
                self._free_node(n, devs, hosts)
            else:
                self._detach(n)

    def _detach(self, n: int) -> None:
        """Out of the tree but still held: its blocks count as in use, not cached."""
        if self._obs is not None:
            self._tell_lost(n)
        self._dev_cached -= self._dev_v[n] >= 0
        self._host_cached -= self._host_v[n] >= 0
        self._dev_lru.discard_one(n)
        self._host_lru.discard_one(n)
        self._keys[n] = None
        self._state_v[n] = DETACHED
        self._parent_v[n] = self._child_v[n] = self._next_v[n] = self._prev_v[n] = -1
        self._cont_v[n] = -1
        self._ndev_v[n] = 0

    def _free_node(self, n: int, devs: list[int], hosts: list[int]) -> None:
        """Give n's blocks to the batches `devs` / `hosts` and its id back to the stack. Every
        field is reset here, so a node id on the stack is clean and creating a node writes only
        the fields that differ (the checker verifies this)."""
        state = self._state_v[n]
        cached = state != DETACHED
        if cached and self._obs is not None:
            self._tell_lost(n)
        if cached and self._remembers:
            self._dev_lru.forget(np.array([n], dtype=np.int32), self._keys)
        if state == GPU and self._ref_v[n] == 0:
            self._idle -= 1
        d = self._dev_v[n]
        if d >= 0:
            copying = self._wanted_back.pop(n, -1)
            if copying >= 0:  # matched back while a swap-out copied it: the copy still reads it
                self._tasks[copying].dev_orphans.append(d)
            else:
                devs.append(d)
            self._dev_cached -= cached
        h = self._host_v[n]
        if h >= 0:
            hosts.append(h)
            self._host_cached -= cached
        self._dev_lru.discard_one(n)
        self._host_lru.discard_one(n)
        self._keys[n] = None
        self._parent_v[n] = self._child_v[n] = self._dev_v[n] = self._host_v[n] = -1
        self._next_v[n] = self._prev_v[n] = self._cont_v[n] = -1
        self._ref_v[n] = self._ndev_v[n] = self._hits_v[n] = 0
        self._state_v[n] = FREE
        self._task_v[n] = -1
        self._stack_v[self._top] = n
        self._top += 1

    # ---- the observer (called only when there is one)
    def _tell_stored(self, medium: str, nodes: Sequence[int]) -> None:
        """`nodes`, a chain (parent first), now hold readable blocks on `medium` (a side node,
        runtime/cache/groups.py, alone: its group is said)."""
        keys = self._keys
        group = int(self._group[nodes[0]])
        if group:
            self._obs.stored(medium, [keys[n] for n in nodes], keys[self._parent_v[nodes[0]]], group=group)
        else:
            self._obs.stored(medium, [keys[n] for n in nodes], keys[self._parent_v[nodes[0]]])

    def _tell_moved(self, n: int, src: str, dst: str) -> None:
        """n's block left `src` for `dst` (a finished swap, or a host node computed again)."""
        self._obs.removed(src, (self._keys[n],))
        self._tell_stored(dst, (n,))

    def _tell_lost(self, n: int) -> None:
        """n leaves the cache: the blocks it was announced with are gone. A copy still being
        swapped in or out was never announced (it is stored once readable)."""
        key, state = (self._keys[n],), self._state_v[n]
        if self._dev_v[n] >= 0 and state in (GPU, SWAP2CPU):
            self._obs.removed(ON_DEVICE, key)
        if self._host_v[n] >= 0 and state in (CPU, SWAP2GPU):
            self._obs.removed(ON_HOST, key)

    def _push_ids(self, ids: list[int]) -> None:
        """Return node ids that were taken but never used (their fields were never written)."""
        top = self._top
        self._stack[top:top + len(ids)] = ids
        self._top = top + len(ids)

    def _device_child_gone(self, p: int) -> None:
        """One of p's children left the device; p may now be an evictable device leaf."""
        left = self._ndev_v[p] - 1
        self._ndev_v[p] = left
        if (left == 0 and self._state_v[p] == GPU and self._ref_v[p] == 0
                and p not in self._dev_lru and p not in self._handed_out):
            self._dev_lru.push_front(p)

