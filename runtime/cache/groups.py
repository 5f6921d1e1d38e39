"""Layer groups in the prefix cache: the pages of a model's other layer groups as side nodes.

A model whose layers attend differently (full attention and sliding windows: Gemma 2 and 3,
Mistral-style models; ipc/layout.py LayerGroups) has, for each block of tokens, one page per
layer group in the one device pool. Group 0's pages are the tree as for any model. A page of
side group g (g >= 1) is a *side node*: a child of group 0's node for the same block, named
`group_key(key, g)` (runtime/cache/keys.py) and found through the key map (never a
continuation, so the walk of group 0's chains is what it was). Being nodes, side pages get
everything nodes have: device and host states, swap-outs and swap-ins, the eviction policy's
order (a side node is a leaf, so group 0's node under it goes only after it), transfer tasks,
KV events, the reset, and the invariant checker.

- **Matching** (`_viable`): a hit of n blocks needs group 0's nodes for blocks 0..n-1 and
  each side group's for the blocks its layers still read from position n*block_size on: all
  of them for a full-attention side group, only the last ones for a sliding window of W
  tokens (blocks [lo, n), lo = (n*bs - W + 1) // bs). The walk of group 0 gives the longest
  candidate; the hit is the longest n at or below it whose side blocks are all cached (a
  missing one at j rules out every n above j whose window holds j).
- **Sliding** (`_slide`): once a request's next position p is past a block's last key by W
  (block i < (p - W + 1) // bs), no later query of its sliding layers reads the block: the
  request lets go of it, its page going back to the pool if private, its node becoming
  evictable if recorded. Computed blocks are recorded in every group, so a later request
  that diverges at this point finds the window it needs there while it lasts. But a sliding
  page serves a hit only for a request that diverges within a window after it, and most of the
  pages a long prefill lets go of (as many as its blocks, per sliding group) lie where no
  request will: queued as recently used, they would push out the blocks and last windows of
  finished requests. So a released sliding page goes to the front of the eviction queue
  (`push_front`: evicted before anything else), except where later requests are likely to
  diverge: within two windows of the end of the request's prompt (a conversation continues
  from there: the next turn diverges at most a window before it, at a chat template's turn
  markers or a trace's block boundary, and reads the window before that point), and in the
  window before the point where the request itself diverged from what was cached (a branch
  that others took before it). Those are released in the ordinary order, as a finished
  request's pages are. (Measured on the conversation trace: with every released page
  queued as recently used, a Gemma-3-shaped cache held 1.5 times the blocks of its all-full
  counterpart in the same memory and hit less; with every one at the front, 5 times the blocks
  and almost no hit, the windows before the turns' ends gone.)
- **Allocation**: a new block of tokens takes one page per group, all from the one pool
  (`PrefixCache.allocate`): a step writes every layer's K and V.

The request's view of a side group is `SideRefs`: its node (a reference held) and page per
block, -1 where it has none (not matched, or released); `group_tables` are what the step batch
carries for the worker's layers of each group, -1 where a sliding layer reads nothing.
"""
from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from kvrt.runtime.cache.keys import group_key
from kvrt.runtime.cache.match import MatchRecord, Request
from kvrt.runtime.cache.nodes import GPU, NO_NODES, ON_DEVICE, SWAP2GPU


class SideRefs:
    """One request's blocks of one side group, indexed by block: `nodes[i]` the side node it
    holds a reference on (-1: none), `blocks[i]` the page its layers read and write (the
    node's, or a private one; -1: none); `dups` private pages kept beside a node still being
    swapped in; blocks before `live` were released (they left the group's window)."""

    __slots__ = ("nodes", "blocks", "dups", "live")

    def __init__(self) -> None:
        self.nodes: list[int] = []
        self.blocks: list[int] = []
        self.dups: list[int] = []
        self.live = 0

    def held(self) -> list[int]:
        return [n for n in self.nodes if n >= 0]

    def private(self) -> list[int]:
        """Pages the request owns alone: those of blocks with no node, and copies (`dups`)."""
        return [b for n, b in zip(self.nodes, self.blocks) if n < 0 and b >= 0] + self.dups


class SideGroups(MatchRecord):
    """Side groups, mixed into PrefixCache. `_side_w[g]`: side group g + 1's window in tokens
    (0: full attention); empty for a model of one group, where none of this runs."""

    _side_w: list[int]
    _group: np.ndarray  # node -> its group (0 for group 0's nodes); read for KV events

    def _lo(self, g: int, pos: int) -> int:
        """The first block side group g + 1's layers read from position `pos` on."""
        w = self._side_w[g]
        return 0 if w == 0 else max(0, (pos - w + 1) // self.block_size)

    def _viable(self, keys: Sequence[bytes], path: np.ndarray) -> tuple[int, list[dict[int, int]]]:
        """The longest hit at or below `path` (group 0's walk) whose side blocks are all cached,
        and the side nodes found per group (block -> node; those of the hit included)."""
        n = len(path)
        found: list[dict[int, int]] = [{} for _ in self._side_w]
        missing: list[set[int]] = [set() for _ in self._side_w]
        nodes = path.tolist()
        while n > 0:
            gap = -1
            for g in range(len(self._side_w)):
                have, miss = found[g], missing[g]
                for i in range(n - 1, self._lo(g, n * self.block_size) - 1, -1):
                    if i in have:
                        continue
                    if i not in miss:
                        c = self._child(nodes[i], group_key(keys[i], g + 1))
                        if c >= 0:
                            have[i] = c
                            continue
                        miss.add(i)
                    gap = max(gap, i)
                    break
            if gap < 0:
                return n, found
            n = gap  # every hit above the gap would need its block
        return 0, found

    def _side_hit(self, req: Request, n: int, found: list[dict[int, int]]) -> np.ndarray:
        """Set up the request's side groups for a hit of `n` blocks; the side nodes it must
        reference, group after group, in block order (all of them referenced together with
        group 0's path, so no eviction in between can take one)."""
        req.side = []
        ids = []
        for g, have in enumerate(found):
            refs = SideRefs()
            refs.live = self._lo(g, n * self.block_size)
            refs.nodes = [-1] * n
            refs.blocks = [-1] * n
            for i in range(refs.live, n):
                refs.nodes[i] = have[i]
                ids.append(have[i])
            req.side.append(refs)
        return np.array(ids, dtype=np.int32) if ids else NO_NODES

    def _side_blocks(self, req: Request, blocks: list[int]) -> None:
        """The pages of the side nodes just referenced (`blocks`, in `_side_hit`'s order;
        -1 for a deferred swap-in's destination, filled in when it is issued)."""
        at = 0
        for refs in req.side:
            for i in range(refs.live, len(refs.nodes)):
                refs.blocks[i] = blocks[at]
                at += 1

    def _side_need(self, req: Request, need: int, reads_from: int) -> list[int]:
        """Pages each side group needs for the `need` blocks of tokens the request adds: one
        each, but none before a sliding window that reads from position `reads_from` on."""
        first = len(req.blocks)
        return [need - min(need, max(0, self._lo(g, reads_from) - first)) for g in range(len(self._side_w))]

    def _side_grow(self, req: Request, need: int, pages: list[int], counts: list[int]) -> None:
        """The request's `need` new blocks of tokens got their pages (`pages`: `counts[g]` for
        side group g, group after group, for its last blocks; none for the ones before)."""
        at = 0
        for refs, k in zip(req.side, counts):
            refs.blocks += [-1] * (need - k) + pages[at:at + k]
            refs.nodes += [-1] * need
            at += k

    def _record_sides(self, req: Request, start: int) -> None:
        """Record the request's side pages of the blocks group 0 just recorded (path[start:]),
        as `_record_slow` records group 0's: a key already cached is adopted (the request reads
        the node's page from now on and frees its own; a node still being swapped in is read
        from the request's own copy until it arrives)."""
        path = req.path.tolist()
        freed: list[int] = []
        keys, found, parent_v = req.keys, self._map.get, self._parent_v
        for g, refs in enumerate(req.side):
            nodes, blocks = refs.nodes, refs.blocks
            for i in range(max(start, refs.live), len(path)):
                page = blocks[i]
                if nodes[i] >= 0 or page < 0:
                    continue
                key = group_key(keys[i], g + 1)
                parent = path[i]
                c = found(key, -1)  # (a side node is never a continuation: the key map has it)
                if c < 0 or parent_v[c] != parent:
                    c = int(self._stack[self._top - 1])
                    self._top -= 1
                    self._new_side(c, key, parent, page, g + 1)
                elif not self._adopt(c, page):
                    if self._state_v[c] == SWAP2GPU:
                        refs.dups.append(page)
                    else:
                        blocks[i] = self._dev_v[c]
                        freed.append(page)
                nodes[i] = c
        self.device_pool.free(freed)

    def _new_side(self, n: int, key: bytes, parent: int, page: int, group: int) -> None:
        """A side node holding `page`, referenced once (by the request that computed it)."""
        self._keys[n] = key
        self._dev_v[n] = page
        self._ref_v[n] = 1
        self._state_v[n] = GPU
        self._group[n] = group
        self._map[key] = n  # `_link` of a side node, written out: first child, found by key
        head = self._child_v[parent]
        self._parent_v[n] = parent
        self._next_v[n] = head
        if head >= 0:
            self._prev_v[head] = n
        self._child_v[parent] = n
        self._ndev_v[parent] += 1
        self._dev_cached += 1
        if self._obs is not None:
            self._tell_stored(ON_DEVICE, (n,))

    def _slide(self, req: Request, pos: int) -> None:
        """The request's next position is `pos`: let go of every sliding group's blocks its
        window has left (nodes dereferenced, private pages freed; in the eviction order the
        module docstring gives)."""
        drop: list[int] = []
        keep: list[int] = []
        free: list[int] = []
        bs = self.block_size
        for g, refs in enumerate(req.side):
            lo = min(self._lo(g, pos), len(refs.blocks))
            w = -(-self._side_w[g] // bs)
            tail, branch = req.num_tokens // bs - 2 * w, self._lo(g, req.diverged * bs)
            for i in range(refs.live, lo):
                n, b = refs.nodes[i], refs.blocks[i]
                if n >= 0:
                    (keep if i >= tail or branch <= i < req.diverged else drop).append(n)
                    if b in refs.dups:
                        refs.dups.remove(b)
                        free.append(b)
                elif b >= 0:
                    free.append(b)
                refs.nodes[i] = refs.blocks[i] = -1
            refs.live = max(refs.live, lo)
        self.device_pool.free(free)
        if drop:
            self._deref(np.array(drop, dtype=np.int32), front=True)
        if keep:
            self._deref(np.array(keep[::-1], dtype=np.int32))

    def _side_release(self, req: Request) -> np.ndarray:
        """Free the request's private side pages; the side nodes it references, deepest block
        first (for the caller to release with or before group 0's path)."""
        nodes: list[int] = []
        for refs in req.side:
            self.device_pool.free(refs.private())
            nodes += refs.held()
        nodes.reverse()
        return np.array(nodes, dtype=np.int32) if nodes else NO_NODES

    def _side_spans(self, req: Request, hits: int) -> list[tuple[int, int]]:
        """Per side group, the blocks [first, end) a storage read of `hits` blocks after the
        request's hit must bring too: those its window reads from the read's end on that the
        hit does not hold (the request references the ones before)."""
        start = len(req.blocks)
        end = start + hits
        return [(max(start, self._lo(g, end * self.block_size)), end) for g in range(len(self._side_w))]

    def _side_read(self, req: Request, hits: int, pages: list[int], spans: list[tuple[int, int]]) -> None:
        """The side groups' tables grow with the `hits` blocks a storage read brings: `pages`
        for the blocks of `spans`, none before."""
        at = 0
        for refs, (first, end) in zip(req.side, spans):
            refs.nodes += [-1] * hits
            refs.blocks += [-1] * hits
            for i in range(first, end):
                refs.blocks[i] = pages[at]
                at += 1

    def _side_unread(self, req: Request, n: int) -> None:
        """A storage read brought nothing: the side groups' tables end at block `n` again (the
        read's pages are freed by the caller)."""
        for refs in req.side:
            del refs.nodes[n:]
            del refs.blocks[n:]

    def _side_forget(self, req: Request, pages) -> None:
        """The request leaves while a storage read still writes `pages`: they are the task's to
        free, no longer the request's."""
        gone = set(np.asarray(pages).tolist())
        for refs in req.side:
            refs.blocks = [-1 if n < 0 and b in gone else b for n, b in zip(refs.nodes, refs.blocks)]

    def _side_tail(self, req: Request) -> np.ndarray:
        """For write-through: the side nodes of the window before the one the request still
        holds at its end, referenced now (the write's task releases them). A later request of
        the same prompt hits a block short of its end (its last token is computed again), and
        its window starts that much earlier."""
        out = []
        path, bs = req.path.tolist(), self.block_size
        for g, refs in enumerate(req.side):
            if not self._side_w[g]:
                continue
            w = -(-self._side_w[g] // bs)
            for i in range(max(req.num_matched, refs.live - w), min(refs.live, len(path))):
                c = self._child(path[i], group_key(req.keys[i], g + 1))
                if c >= 0 and self._state_v[c] == GPU:
                    if self._ref_v[c] == 0:
                        self._dev_lru.discard_one(c)
                        self._idle -= 1
                    self._ref_v[c] += 1
                    out.append(c)
        return np.array(out, dtype=np.int32) if out else NO_NODES

    def _side_fill_deferred(self, req: Request) -> None:
        """A deferred swap-in the request waits for got its device blocks: its side pages too."""
        dev = self._dev_v
        for refs in req.side:
            for i, n in enumerate(refs.nodes):
                if n >= 0 and refs.blocks[i] < 0:
                    refs.blocks[i] = dev[n]

    def _side_held_pages(self, req: Request) -> int:
        return sum(sum(b >= 0 for b in refs.blocks) + len(refs.dups) for refs in req.side)

    def group_tables(self, request_id: Hashable) -> list[list[int]]:
        """The request's page of each block for each side group (-1: none; a sliding layer
        does not read it), in the order of `block_table`."""
        req = self._request(request_id)
        return [list(refs.blocks) for refs in req.side] if req.side else []
