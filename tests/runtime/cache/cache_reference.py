"""The prefix cache's C loops (runtime/cache/_cache_core.c) in Python, and its eviction one victim at a
time: the references the production code is tested against, never run in production.

Why here: the cache has one implementation of each loop, in C, and one batched eviction path;
a second production path would be a second thing to keep equal. Each function below takes the
arguments of the C function of the same name and does what it does with numpy and Python
loops (the code the C replaced), so a test can put it in place of the C function in the
module that calls it (tests/runtime/cache/test_cache_core.py, test_use_sketch.py, test_hashing.py) and run
the same production code both ways. `OneAtATime` is a prefix cache whose eviction pops and
drops (or swaps out) one victim at a time, what the batched paths of
runtime/cache/eviction.py must reproduce exactly (tests/runtime/cache/test_eviction_policies.py).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Sequence

import numpy as np
from xxhash import xxh3_128_digest

from kvrt.runtime.cache.keys import KEY_BYTES, TOKEN_DTYPE
from kvrt.runtime.cache.nodes import DEV, HOST, ROOT, SWAP2CPU
from kvrt.runtime.cache.prefix_cache import PrefixCache


def chain_keys(token_bytes: bytes, block_size: int, parent: bytes) -> list[bytes]:
    """Keys of the full blocks of `token_bytes`: xxh3-128 of (parent key || block's bytes)."""
    if block_size <= 0 or len(parent) != KEY_BYTES:
        raise ValueError(f"chain_keys: need block_size > 0 and a {KEY_BYTES}-byte parent key")
    step = block_size * TOKEN_DTYPE.itemsize
    keys = []
    key = parent
    for off in range(0, len(token_bytes) // step * step, step):
        key = xxh3_128_digest(key + token_bytes[off:off + step])
        keys.append(key)
    return keys


# ---- the use sketch (runtime/cache/use_sketch.py)
def _slots(keys: Sequence[bytes], mask: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Two slots per 16-byte key (its first 8 bytes, native order, masked; the same shifted right
    by 32, masked); None if a key is not 16 bytes."""
    if not all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys):
        return None
    h = np.frombuffer(b"".join(keys), dtype=np.uint64)[::2]
    m = np.uint64(mask)
    return h & m, (h >> np.uint64(32)) & m


def sketch_add(r0: np.ndarray, r1: np.ndarray, keys: Sequence[bytes], mask: int, s0: np.ndarray | None = None,
               s1: np.ndarray | None = None, now: int = 0, ages: np.ndarray | None = None) -> bool:
    slots = _slots(keys, mask)
    if slots is None:
        return False
    a, b = slots
    if ages is not None:
        last = np.minimum(s0[a], s1[b]).astype(np.int64)
        ages[:len(keys)] = np.where(last > 0, now - last, -1)
        s0[a] = now
        s1[b] = now
    r0[a] = np.minimum(r0[a], 254) + 1  # gather, then scatter: a shared slot gains one
    r1[b] = np.minimum(r1[b], 254) + 1
    return True


def sketch_count(r0: np.ndarray, r1: np.ndarray, keys: Sequence[bytes], mask: int, out: np.ndarray) -> bool:
    slots = _slots(keys, mask)
    if slots is None:
        return False
    a, b = slots
    out[:len(keys)] = np.minimum(r0[a], r1[b])
    return True


def sketch_raise(r0: np.ndarray, r1: np.ndarray, keys: Sequence[bytes], mask: int, hits: np.ndarray,
                 nodes: np.ndarray, cap: int | None) -> bool:
    earlier = np.empty(len(keys), dtype=np.int32)
    if not sketch_count(r0, r1, keys, mask, earlier):
        return False
    earlier -= 1
    if cap is not None and len(earlier) and earlier[0] > cap:  # a running minimum from a capped
        earlier[0] = cap                                        # first value is capped throughout
    np.minimum.accumulate(earlier, out=earlier)
    np.maximum(earlier, 0, out=earlier)
    hits[nodes] = np.maximum(hits[nodes], earlier)
    return True


# ---- matching, recording, references (runtime/cache/match.py)
def walk(f: np.ndarray, cont_row: int, parent_row: int, node_keys: list, kmap: dict, keys: Sequence[bytes],
         limit: int, out: np.ndarray) -> int:
    cont, parent = memoryview(f[cont_row]), memoryview(f[parent_row])
    n = ROOT
    for i in range(limit):
        key = keys[i]
        c = cont[n]
        if c < 0 or node_keys[c] != key:
            c = kmap.get(key)
            if c is None or parent[c] != n:  # (a key that was not chained: another branch)
                return i
        out[i] = n = c
    return limit


def touch_device(f: np.ndarray, path: np.ndarray, ref_row: int, hits_row: int, state_row: int, dev_row: int,
                 gpu: int) -> tuple[int, list[int]] | None:
    if (f[state_row, path] != gpu).any():
        return None
    refs = f[ref_row, path]
    f[ref_row, path] = refs + 1
    f[hits_row, path] += 1
    return int(np.count_nonzero(refs == 0)), f[dev_row, path].tolist()


def deref(f: np.ndarray, path: np.ndarray, ref_row: int, state_row: int, gpu: int,
          out: np.ndarray) -> tuple[int, bool]:
    a = path[::-1]
    r = f[ref_row, a] - 1
    f[ref_row, a] = r
    zero = a[r == 0]
    out[:len(zero)] = zero
    return len(zero), bool((f[state_row, zero] == gpu).all())


def new_chain(f: np.ndarray, ids: np.ndarray, parent: int, blocks: list[int], rows: tuple, gpu: int,
              node_keys: list, keys: Sequence[bytes]) -> None:
    parent_r, child_r, dev_r, ref_r, ndev_r, state_r, cont_r = rows
    for n, key in zip(ids.tolist(), keys):
        node_keys[n] = key
    child = np.append(ids[1:], -1)
    f[parent_r, ids] = np.insert(ids[:-1], 0, parent)
    f[child_r, ids] = child
    f[dev_r, ids] = blocks
    f[ref_r, ids] = 1
    f[ndev_r, ids] = child >= 0  # each node's one child is the next, on the device
    f[state_r, ids] = gpu
    f[cont_r, ids] = child


# ---- eviction runs (runtime/cache/eviction.py)
def chain_tops(f: np.ndarray, cand: np.ndarray, par: np.ndarray, ndev_row: int) -> list[int] | None:
    nd = f[ndev_row, cand]
    link = par[:-1] == cand[1:]  # the next node of the run is this one's parent
    if nd[0] == 0 and (nd[1:] == link).all():
        return np.flatnonzero(~link).tolist() + [len(cand) - 1]
    return None


def drop_run(f: np.ndarray, drop: np.ndarray, par: np.ndarray, top: list[int], rows: tuple, reset: tuple,
             node_keys: list, kmap: dict, devs: list[int], stack: np.ndarray, at: int) -> list[int]:
    parent_r, child_r, next_r, prev_r, cont_r, ndev_r, dev_r = rows
    for v in drop[f[cont_r, par] != drop].tolist():
        del kmap[node_keys[v]]  # found through the key map, not as their parent's continuation
    freed_parents = []
    for v in drop[top].tolist():  # unlinked from the parent that stays
        p, before, after = (int(x) for x in f[[parent_r, prev_r, next_r], v])
        if f[cont_r, p] == v:
            f[cont_r, p] = -1
        if before >= 0:
            f[next_r, before] = after
        else:
            f[child_r, p] = after
        if after >= 0:
            f[prev_r, after] = before
        f[ndev_r, p] -= 1
        if f[ndev_r, p] == 0:
            freed_parents.append(p)
    for v in drop.tolist():
        node_keys[v] = None
    devs += f[dev_r, drop].tolist()
    f[:, drop] = np.array(reset, dtype=np.int32)[:, None]
    stack[at:at + len(drop)] = drop
    return freed_parents


# ---- the `reuse` queue (runtime/cache/policies/reuse.py)
def pop_live(heap: list, stamp: np.ndarray, k: int, out: np.ndarray) -> tuple[int, int]:
    taken = dropped = 0
    while heap and taken < k:
        e = heap[0]
        start = max(e[5], 0)
        nodes = np.asarray(e[4][start:], dtype=np.int32)
        i = 0
        while i < len(nodes) and taken < k:
            v = nodes[i]
            i += 1
            if stamp[v] == e[3]:
                stamp[v] = -1
                out[taken] = v
                taken += 1
        if taken == k:
            e[5] = start + i
            break
        heapq.heappop(heap)
        dropped += len(e[4])
    return taken, dropped


def stamp_runs(stamp: np.ndarray, nodes: np.ndarray, level: np.ndarray, serial: int) -> list[int]:
    if not len(nodes):
        return []
    starts = [0] + (np.flatnonzero(level[1:] != level[:-1]) + 1).tolist()
    for j, (a, b) in enumerate(zip(starts, starts[1:] + [len(nodes)])):
        stamp[nodes[a:b]] = serial + j
    return starts


# ---- the `reuse` family's per-node bookkeeping (runtime/cache/policies/reuse.py, gaps.py)
def policy_release(hits: np.ndarray, matched: np.ndarray, released: np.ndarray, nodes: np.ndarray, now: int) -> int:
    lost = int(np.count_nonzero(hits[nodes][~matched[nodes]]))
    matched[nodes] = False
    released[nodes] = now
    return lost


def policy_discard(stamp: np.ndarray, released: np.ndarray, matched: np.ndarray, nodes: np.ndarray, clock: int,
                   turnover: float) -> tuple[int, int]:
    queued = nodes[stamp[nodes] >= 0]
    long = int(np.count_nonzero(clock - released[queued] > turnover))
    matched[nodes] = True
    stamp[nodes] = -1
    return len(queued), long


def ghost_ages(ghost: np.ndarray, nodes: np.ndarray, ages: np.ndarray) -> None:
    ghost[nodes] = np.maximum.accumulate(ages)


def gaps_rank(hits: np.ndarray, ghost: np.ndarray, prio_row: np.ndarray, stamp: np.ndarray, nodes: np.ndarray,
              levels: np.ndarray, hold_by_uses: np.ndarray, now: int, unit: float, far1: float, far2: float,
              span: int, serial: int, heap: list) -> int:
    h = hits[nodes]
    gap = ghost[nodes]
    ghost[nodes] = -1
    lv = levels[np.minimum(h, len(levels) - 1)]
    if unit > 0:
        uses = np.minimum(h, len(hold_by_uses) - 1)
        hold = hold_by_uses[uses]
        hold[((uses == 1) & (gap > far1)) | ((uses == 2) & (gap > far2))] = 0.0
        due = now + (unit * hold).astype(np.int64)
    else:
        due = np.full(len(nodes), now, dtype=np.int64)
    prio = due * span + lv
    prio_row[nodes] = prio
    starts = [0] + (np.flatnonzero(prio[1:] != prio[:-1]) + 1).tolist() if len(nodes) else []
    ends = starts[1:] + [len(nodes)]
    for j, (a, b) in enumerate(zip(starts, ends)):
        stamp[nodes[a:b]] = serial + j
        heapq.heappush(heap, [int(prio[a]), int(lv[a]), serial + j, serial + j, nodes[a:b], -1])
    return len(starts)


# ---- the host tier's eviction bookkeeping (runtime/cache/eviction.py)
def drop_host_run(f: np.ndarray, cand: np.ndarray, rows: tuple, cpu: int, reset: tuple, node_keys: list,
                  kmap: dict, hosts: np.ndarray, h_at: int, stack: np.ndarray, at: int,
                  policy) -> tuple[int, int] | None:
    parent, child, nxt, prev, cont, state, ref, host = rows
    m = len(cand)
    g = f[:, cand]
    par, ch = g[parent], g[child]
    link = par[:-1] == cand[1:]
    # a node goes if it has no child, or its only child is the run's node right before it
    only = link & (g[prev, :-1] < 0) & (g[nxt, :-1] < 0)
    usual = (ch[0] < 0 and (g[state] == cpu).all() and ((ch[1:] < 0) | (only & (ch[1:] == cand[:-1]))).all()
             and not (link & ~only).any())
    if not usual:
        return None
    mapped = f[cont, par] != cand  # found through the key map, not as their parent's continuation
    top = np.flatnonzero(~link).tolist()
    top.append(m - 1)
    cut, leaf = m, -1
    for t in top:
        v = int(cand[t])
        p, before, after = int(f[parent, v]), int(f[prev, v]), int(f[nxt, v])
        if f[cont, p] == v:
            f[cont, p] = -1
        if before >= 0:
            f[nxt, before] = after
        else:
            f[child, p] = after
        if after >= 0:
            f[prev, after] = before
        if f[child, p] < 0 and f[state, p] == cpu and f[ref, p] == 0 and p not in policy:
            cut, leaf = t + 1, p
            break
    cand, g, mapped = cand[:cut], g[:, :cut], mapped[:cut]
    for v in cand[mapped].tolist():
        del kmap[node_keys[v]]
    for v in cand.tolist():
        node_keys[v] = None
    hosts[h_at:h_at + cut] = g[host]
    f[:, cand] = np.array(reset, dtype=np.int32)[:, None]
    stack[at:at + cut] = cand
    return cut, leaf


def mark_swap_out(f: np.ndarray, vs: np.ndarray, task: np.ndarray, hosts: np.ndarray, victims: np.ndarray,
                  devs: np.ndarray, at: int, rows: tuple, swap2cpu: int, task_id: int, node_keys: list,
                  victim_keys: list) -> None:
    host, dev, state, ndev = rows
    e = len(vs)
    f[host, vs] = hosts[at:at + e]
    victims[at:at + e] = vs
    devs[at:at + e] = f[dev, vs]
    f[state, vs] = swap2cpu
    task[vs] = task_id
    victim_keys += [node_keys[v] for v in vs.tolist()]
    f[ndev, vs] = 0


def drop_host_nodes(f: np.ndarray, cand: np.ndarray, rows: tuple, cpu: int, node_keys: list, kmap: dict,
                    pos: np.ndarray, policy, out: np.ndarray) -> tuple[int, int, int]:
    parent, child, nxt, prev, cont, state, ref = rows
    if not (f[state, cand] == cpu).all():
        raise RuntimeError("the host eviction queue holds a node that is not on the host only")
    ids = cand.tolist()
    at = {v: i for i, v in enumerate(ids)}
    freed: list[int] = []
    for i, v in enumerate(ids):
        if f[child, v] >= 0:
            continue
        p, before, after = int(f[parent, v]), int(f[prev, v]), int(f[nxt, v])
        last = (at.get(p, -1) <= i and f[child, p] == v and after < 0 and before < 0
                and f[state, p] == cpu and f[ref, p] == 0 and p not in policy)
        if f[cont, p] != v:
            del kmap[node_keys[v]]
        if f[cont, p] == v:
            f[cont, p] = -1
        if before >= 0:
            f[nxt, before] = after
        else:
            f[child, p] = after
        if after >= 0:
            f[prev, after] = before
        out[len(freed)] = v
        freed.append(v)
        if last:
            return len(freed), i, p
    return len(freed), -1, -1


def free_host_nodes(f: np.ndarray, nodes: np.ndarray, task: np.ndarray, stack: np.ndarray, hosts: np.ndarray,
                    at: int, h_at: int, host_row: int, reset: tuple, node_keys: list) -> None:
    k = len(nodes)
    for v in nodes.tolist():
        node_keys[v] = None
    hosts[h_at:h_at + k] = f[host_row, nodes]
    f[:, nodes] = np.array(reset, dtype=np.int32)[:, None]
    task[nodes] = -1
    stack[at:at + k] = nodes


def finish_swap_out(f: np.ndarray, nodes: np.ndarray, task: np.ndarray, task_id: int, rows: tuple, swap2cpu: int,
                    cpu: int) -> list[int] | None:
    dev, state = rows
    if not ((task[nodes] == task_id).all() and (f[state, nodes] == swap2cpu).all()):
        return None
    devs = f[dev, nodes].tolist()
    f[dev, nodes] = -1
    f[state, nodes] = cpu
    task[nodes] = -1
    return devs


class OneAtATime(PrefixCache):
    """A prefix cache whose eviction pops one victim at a time from its policies and swaps it
    out or drops it (the loop the cache ran before its eviction was batched): device victims
    get host blocks while any can be had (free ones, then one host leaf dropped at a time),
    else are dropped with their subtree."""

    def _evict_device(self, n: int) -> None:
        pop = self._dev_lru.pop
        swap = self.host_pool.num_blocks > 0
        hosts = self.host_pool.allocate(min(n, self.host_pool.num_free)) if swap else []
        hosts.reverse()  # pop() then hands them out in the order they came
        victims: list[int] = []
        victim_keys: list[bytes] = []  # taken now: a victim may be detached before the end
        dropped: list[int] = []
        freed_hosts: list[int] = []
        evicted = 0
        task_id = -1  # of the swap-out, numbered at its first victim
        ndev, child, wanted_back = self._ndev_v, self._child_v, self._wanted_back
        while evicted < n:
            v = pop()
            if v < 0:
                break
            if ndev[v] or v in wanted_back:
                continue  # parked
            evicted += 1
            if swap and not hosts:
                hosts = self._take_host(1)
                swap = bool(hosts)
            if hosts:
                if task_id < 0:
                    task_id = next(self._task_ids)
                self._host_v[v] = hosts.pop()
                self._host_cached += 1
                self._idle -= 1
                self._state_v[v] = SWAP2CPU
                # the task is known at once, so a parent dropped later in this loop sees its
                # child in flight and detaches it instead of freeing it under the copy
                self._task_v[v] = task_id
                victims.append(v)
                victim_keys.append(self._keys[v])
                self._device_child_gone(self._parent_v[v])
            elif child[v] < 0:
                self._drop_leaf(v, dropped)
            else:
                self._drop_subtree(v, dropped, freed_hosts)
        g = self._f[:, victims]
        self._finish_eviction(dropped, freed_hosts, hosts, victims, victim_keys, evicted, task_id,
                              (g[DEV].tolist(), g[HOST].tolist()))

    def _take_host(self, n: int) -> list[int]:
        got = self.host_pool.allocate(min(n, self.host_pool.num_free))
        dropped = 0
        while len(got) < n:
            v = self._host_lru.pop()
            if v < 0:
                break
            if self._child_v[v] >= 0:
                continue  # parked: requeued when its last child leaves
            self._unlink(v)
            self._free_node(v, [], got)
            dropped += 1
        self.metrics.evicted_host_blocks += dropped
        return got
