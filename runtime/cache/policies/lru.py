"""Least-recently-used order of one tier's evictable tree nodes: a lazily invalidated queue.

Why not an OrderedDict or an intrusive doubly-linked list: at a million cached blocks each of
their per-block pointer updates is a cache miss, and an engine touches every block of every
request twice (matched: leave the list; released: rejoin it). Measured on the CI machine kind,
OrderedDict insertion costs ~370 ns per block at 1.4 M entries, more than all other per-block
work of the cache together. Here a released path joins the queue as one numpy array (one push
per request, whatever its length) and a node taken back into use is never searched for: each
node carries the stamp of its latest push, and an entry whose stamp is no longer its node's is
skipped when eviction reaches it. Every pushed entry is examined at most once, so eviction
costs O(1) per block amortised, with no heap and nothing rebuilt on the eviction path. Stale
entries are compacted in one vectorised pass once the queue holds more than twice as many
entries as there are node ids (O(1) per push amortised), which bounds its memory.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from kvrt.runtime.cache.policies.base import EvictionPolicy


class EvictionQueue(EvictionPolicy):
    """Node ids in eviction order (`pop` returns the least recently pushed live one).

    `push` appends at the most-recently-used end; `push_front` puts a node next in line (a node
    that just became a leaf again); `discard` takes nodes out in O(1) by invalidating their
    entries. A node is in the queue iff its stamp is >= 0.
    """

    __slots__ = ("_stamp", "_stamp_v", "_batches", "_front", "_front_stamp", "_pos", "_heads",
                 "_clock", "_queued", "_limit")

    def __init__(self, capacity: int, hits: np.ndarray | None = None):
        self._stamp = np.full(capacity, -1, dtype=np.int64)
        self._stamp_v = memoryview(self._stamp)
        self._batches: deque[tuple[np.ndarray, int]] = deque()
        # the batch being consumed (a list for `pop`, an array for `pop_many`) and its cursor
        self._front: list[int] | np.ndarray = []
        self._front_stamp = -1
        self._pos = 0
        # pushed to the front: a stack of runs, popped first, each (nodes in reverse order, so the
        # next one is its list's last, and the stamp they were pushed with)
        self._heads: list[tuple[list[int], int]] = []
        self._clock = 0
        self._queued = 0  # entries in _batches
        self._limit = 2 * capacity + 1024

    def __contains__(self, n: int) -> bool:
        return self._stamp_v[n] >= 0

    def push(self, nodes: np.ndarray) -> None:
        """Append `nodes` (an int array the queue keeps; do not modify it) in order at the most
        recently used end; a node already queued moves there."""
        if not len(nodes):
            return
        s = self._clock
        self._clock = s + 1
        self._stamp[nodes] = s
        self._batches.append((nodes, s))
        self._queued += len(nodes)
        if self._queued > self._limit:
            self._compact()

    def push_front(self, n: int) -> None:
        """Make `n` (not queued) the next node `pop` returns."""
        s = self._clock
        self._clock = s + 1
        self._stamp_v[n] = s
        self._heads.append(([n], s))

    def push_front_run(self, nodes: list[int]) -> None:
        """`push_front` of each of `nodes` (none queued), the last one first: they come back in
        this order, as one run with one stamp (a grouped model's cache pushes a request's
        released sliding pages so, runtime/cache/groups.py)."""
        if not nodes:
            return
        s = self._clock
        self._clock = s + 1
        self._stamp[np.asarray(nodes, dtype=np.int64)] = s
        self._heads.append((nodes[::-1], s))

    def queued(self, nodes: np.ndarray) -> int:
        """How many of `nodes` are queued."""
        return int(np.count_nonzero(self._stamp[nodes] >= 0))

    def discard(self, nodes: np.ndarray) -> None:
        """Take `nodes` out of the queue (queued or not)."""
        self._stamp[nodes] = -1

    def discard_one(self, n: int) -> None:
        self._stamp_v[n] = -1

    def pop(self) -> int:
        """The least recently pushed queued node, taken out; -1 if none."""
        stamp = self._stamp_v
        heads = self._heads
        while heads:
            run, s = heads[-1]
            while run:
                n = run.pop()
                if stamp[n] == s:
                    if not run:
                        heads.pop()
                    stamp[n] = -1
                    return n
            heads.pop()
        while True:
            front, i, s = self._front, self._pos, self._front_stamp
            if not isinstance(front, list):  # left as an array by pop_many
                front = self._front = front.tolist()
            end = len(front)
            while i < end:
                n = front[i]
                i += 1
                if stamp[n] == s:
                    self._pos = i
                    stamp[n] = -1
                    return n
            if not self._batches:
                self._front, self._pos = [], 0
                return -1
            nodes, self._front_stamp = self._batches.popleft()
            self._queued -= len(nodes)
            self._front, self._pos = nodes.tolist(), 0

    def pop_many(self, k: int) -> np.ndarray:
        """Up to `k` nodes, as `k` calls of `pop` would return them, in one pass per batch."""
        out: list = []
        got = 0
        stamp = self._stamp_v
        heads = self._heads
        while heads and got < k:
            run, s = heads[-1]
            if len(run) == 1:
                n = run[0]
                heads.pop()
                if stamp[n] == s:
                    stamp[n] = -1
                    out.append(np.array([n], dtype=np.int32))
                    got += 1
                continue
            ahead = np.array(run[::-1], dtype=np.int32)  # in the order they come back
            live = np.flatnonzero(self._stamp[ahead] == s)[:k - got]
            used = int(live[-1]) + 1 if len(live) == k - got else len(ahead)
            take = ahead[live]
            self._stamp[take] = -1
            out.append(take)
            got += len(take)
            del run[len(run) - used:]
            if not run:
                heads.pop()
        while got < k:
            front, i, s = self._front, self._pos, self._front_stamp
            if i < len(front):
                rest = np.asarray(front[i:], dtype=np.int32)
                head = rest[:k - got]
                if (self._stamp[head] == s).all():  # the usual case: no stale entry
                    self._stamp[head] = -1
                    out.append(head)
                    got += len(head)
                    if got == k:
                        self._pos = i + len(head)
                        break
                    idx = ()
                else:
                    idx = np.flatnonzero(self._stamp[rest] == s)[:k - got]
                if len(idx):
                    take = rest[idx]
                    self._stamp[take] = -1
                    out.append(take)
                    got += len(take)
                    if got == k:
                        self._pos = i + int(idx[-1]) + 1
                        break
            if not self._batches:
                self._front, self._pos = [], 0
                break
            nodes, self._front_stamp = self._batches.popleft()
            self._queued -= len(nodes)
            self._front, self._pos = nodes, 0
        if not out:
            return np.empty(0, dtype=np.int32)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def members(self) -> list[int]:
        """Queued nodes in eviction order, found through their live entries (for the invariant
        checker: this must equal `stamped()` as a set, each node once)."""
        stamp = self._stamp_v
        out = [n for run, s in reversed(self._heads) for n in reversed(run) if stamp[n] == s]
        front = self._front if isinstance(self._front, list) else self._front.tolist()
        out += [n for n in front[self._pos:] if stamp[n] == self._front_stamp]
        for nodes, s in self._batches:
            out += [n for n in nodes.tolist() if stamp[n] == s]
        return out

    def stamped(self) -> list[int]:
        """Nodes whose stamp says they are queued."""
        return np.nonzero(self._stamp >= 0)[0].tolist()

    def _compact(self) -> None:
        """Keep only live entries of the batches, in order, as one batch with a fresh stamp."""
        batches = list(self._batches)
        nodes = np.concatenate([b for b, _ in batches])
        stamps = np.repeat(np.array([s for _, s in batches], dtype=np.int64), [len(b) for b, _ in batches])
        live = nodes[self._stamp[nodes] == stamps]
        s = self._clock
        self._clock = s + 1
        self._stamp[live] = s
        self._batches = deque([(live, s)])
        self._queued = len(live)
