"""The offline bound of a prefix cache's token hit rate at a given capacity: Belady's policy
(evict what is used again farthest in the future) over the same trace, prefix constraint kept.

The replay it bounds (bench/cache.py) runs requests one after another; a request matches the
longest cached prefix of its full blocks (its last token always computed), then needs device
blocks for the rest of its prompt, partial block included, while it runs; its full blocks are
then cached. Here the cache is a set of blocks closed under prefix (a block is kept only if its
whole prefix is), at most `capacity` blocks counting the running request's new ones. When room
is needed it evicts the kept leaf, outside the running request's matched path, whose next use
is farthest (never used again: first). A request larger than the capacity caches nothing, as
the replay skips it. Only leaves are ever evicted, so the prefix constraint holds by
construction, and a parent is never used later than its children (a request that uses a block
uses its prefix), so the farthest leaf is the farthest block that can go.

Cost: blocks get integer ids and every use its next use in one pass (a dict over the trie and
a numpy sort, shared by all capacities); each capacity is then one pass with a heap of leaves
keyed by next use, lazily invalidated (a leaf's entry is checked when it comes out), so
O(log n) per evicted block: a few seconds for the bundled trace.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from kvrt.runtime.client.trace import TRACE_BLOCK, TraceRequest

NEVER = np.iinfo(np.int64).max


@dataclass
class Uses:
    """Every request's full blocks as integer ids (`blocks[starts[i]:starts[i + 1]]`, each one's
    parent in `parent`), when each block is used next (`next_use`, parallel to `blocks`: the
    index of the next request holding it, NEVER if none), and per request its prompt tokens."""

    blocks: np.ndarray
    next_use: np.ndarray
    starts: np.ndarray
    parent: np.ndarray
    tokens: list[int]


def uses(requests: list[TraceRequest], block_size: int) -> Uses:
    """Number the trace's blocks and compute every use's next use (shared by all capacities)."""
    per_id = TRACE_BLOCK // block_size
    ids: dict[tuple[int, int], int] = {}   # (trie node of the id prefix, trace id) -> trie node
    blocks: list[int] = []
    parent: list[int] = []
    starts = [0]
    for req in requests:
        n_full = req.input_length // block_size
        node = -1
        last = -1
        for j, h in enumerate(req.hash_ids):
            if j * per_id >= n_full:
                break
            key = (node, h)
            node = ids.get(key, -1)
            if node < 0:
                node = ids[key] = len(ids)
            for k in range(min(per_id, n_full - j * per_id)):
                b = node * per_id + k  # the k-th block ending inside this id
                blocks.append(b)
                if len(parent) <= b:
                    parent.extend([-2] * (b + 1 - len(parent)))
                parent[b] = last
                last = b
        starts.append(len(blocks))
    blocks_a = np.array(blocks, dtype=np.int64)
    starts_a = np.array(starts, dtype=np.int64)
    req_of = np.repeat(np.arange(len(requests), dtype=np.int64), np.diff(starts_a))
    order = np.lexsort((req_of, blocks_a))  # by block, then by request
    nxt = np.full(len(blocks_a), NEVER, dtype=np.int64)
    same = blocks_a[order[1:]] == blocks_a[order[:-1]]
    nxt[order[:-1][same]] = req_of[order[1:][same]]
    return Uses(blocks_a, nxt, starts_a, np.array(parent, dtype=np.int64),
                [r.input_length for r in requests])


def offline_hit_rate(u: Uses, block_size: int, capacity: int) -> float:
    """Token hit rate of Belady's policy with the prefix constraint at `capacity` blocks."""
    nb = len(u.parent)
    cached = np.zeros(nb, dtype=bool)
    children = np.zeros(nb, dtype=np.int64)   # cached children per block
    key = np.full(nb, NEVER, dtype=np.int64)  # each cached block's next use
    heap: list[tuple[int, int]] = []          # (-next use, leaf), lazily invalidated
    size = 0
    hit_tokens = 0
    blocks, next_use, starts, parent = u.blocks, u.next_use, u.starts, u.parent
    for i, n in enumerate(u.tokens):
        path = blocks[starts[i]:starts[i + 1]].tolist()
        nxt = next_use[starts[i]:starts[i + 1]].tolist()
        limit = min(len(path), (n - 1) // block_size)
        hit = 0
        while hit < len(path) and cached[path[hit]]:
            hit += 1
        hit_tokens += min(hit, limit) * block_size
        need = -(-n // block_size) - min(hit, limit)  # device blocks the request computes into
        if need + hit > capacity:
            for b, t in zip(path[:hit], nxt[:hit]):
                key[b] = t
            leaf = path[hit - 1] if hit else -1
            if hit and not children[leaf]:
                heapq.heappush(heap, (-key[leaf], leaf))
            continue  # larger than the device: skipped, nothing new is cached
        pinned = set(path[:hit])
        held = []
        while size + need > capacity:
            negt, v = heapq.heappop(heap)
            if not cached[v] or children[v] or key[v] != -negt:
                continue  # stale entry
            if v in pinned:
                held.append((negt, v))
                continue
            cached[v] = False
            size -= 1
            p = parent[v]
            if p >= 0:
                children[p] -= 1
                if not children[p]:
                    heapq.heappush(heap, (-key[p], p))
        for e in held:
            heapq.heappush(heap, e)
        for j, (b, t) in enumerate(zip(path, nxt)):
            key[b] = t
            if j >= hit:
                cached[b] = True
                size += 1
                if j:
                    children[path[j - 1]] += 1
        if path:
            leaf = path[-1]
            if not children[leaf]:
                heapq.heappush(heap, (-key[leaf], leaf))
    total = sum(u.tokens)
    return hit_tokens / total if total else 0.0
