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
import sys
from collections import OrderedDict
from typing import Sequence

import numpy as np
from xxhash import xxh3_128_digest

from kvrt.runtime.cache.keys import KEY_BYTES, TOKEN_DTYPE
from kvrt.runtime.cache.nodes import DEV, HOST, ROOT, SWAP2CPU
from kvrt.runtime.cache.prefix_cache import PrefixCache


def chain_keys(token_bytes, block_size: int, parent: bytes) -> list[bytes]:
    """Keys of the full blocks of `token_bytes` (any contiguous buffer: its bytes as they are):
    xxh3-128 of (parent key || block's bytes)."""
    if block_size <= 0 or len(parent) != KEY_BYTES:
        raise ValueError(f"chain_keys: need block_size > 0 and a {KEY_BYTES}-byte parent key")
    token_bytes = memoryview(token_bytes).cast("B").tobytes()
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
                 gpu: int, ids: list | None = None) -> tuple[int, list[int]] | None:
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


def record_chain(f: np.ndarray, path: np.ndarray, stack: np.ndarray, top: int, keys: Sequence[bytes],
                 blocks: list[int], n_full: int, rows: tuple, gpu: int, detached: int, node_keys: list, kmap: dict,
                 out: np.ndarray) -> int:
    parent_r, child_r, dev_r, ref_r, ndev_r, state_r, cont_r, next_r, prev_r = rows
    i0 = len(path)
    parent = int(path[-1]) if i0 else 0
    if f[state_r, parent] == detached:
        return -1
    key0 = keys[i0]
    c = int(f[cont_r, parent])
    if c >= 0 and node_keys[c] == key0:
        return 0
    c = kmap.get(key0, -1)
    if c >= 0 and f[parent_r, c] == parent:
        return 0
    k = n_full - i0
    ids = stack[top - k:top].copy()
    for n, key in zip(ids.tolist(), keys[i0:n_full]):
        node_keys[n] = key
    child = np.append(ids[1:], -1)
    f[parent_r, ids] = np.insert(ids[:-1], 0, parent)
    f[child_r, ids] = child
    f[dev_r, ids] = blocks[i0:n_full]
    f[ref_r, ids] = 1
    f[ndev_r, ids] = child >= 0  # each node's one child is the next, on the device
    f[state_r, ids] = gpu
    f[cont_r, ids] = child
    first = int(ids[0])  # linked as the parent's first child (NodeStore._link)
    if f[cont_r, parent] < 0:
        f[cont_r, parent] = first
    else:
        kmap[key0] = first
    head = int(f[child_r, parent])
    f[prev_r, first] = -1
    f[next_r, first] = head
    if head >= 0:
        f[prev_r, head] = first
    f[child_r, parent] = first
    f[ndev_r, parent] += 1
    out[:] = np.concatenate((path, ids))
    return k


# ---- eviction runs (runtime/cache/eviction.py)
def chain_tops(f: np.ndarray, cand: np.ndarray, par: np.ndarray, ndev_row: int) -> list[int] | None:
    nd = f[ndev_row, cand]
    link = par[:-1] == cand[1:]  # the next node of the run is this one's parent
    if nd[0] == 0 and (nd[1:] == link).all():
        return np.flatnonzero(~link).tolist() + [len(cand) - 1]
    return None


def drop_run(f: np.ndarray, drop: np.ndarray, par: np.ndarray, top: list[int], rows: tuple, reset: tuple,
             node_keys: list, kmap: dict, devs: list[int], stack: np.ndarray, at: int,
             ids: list[int] | None = None) -> list[int]:
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
    devs += [ids[b] if ids is not None and 0 <= b < len(ids) else b for b in f[dev_r, drop].tolist()]
    f[:, drop] = np.array(reset, dtype=np.int32)[:, None]
    stack[at:at + len(drop)] = drop
    return freed_parents


def drop_chains(f: np.ndarray, cand: np.ndarray, rows: tuple, reset: tuple, node_keys: list, kmap: dict,
                devs: list[int], stack: np.ndarray, at: int, ids: list[int] | None, policy, gpu: int, pos: np.ndarray,
                remember: tuple | None) -> list[int] | None:
    """`Eviction._drop_batched`'s usual run: chain_tops, `_first_trigger` (nothing parked), the
    policy's forget and drop_run, or None (nothing changed) where the run is not whole chains or
    is cut."""
    parent_r, ndev_r, state_r, ref_r, hits_r = rows[0], rows[5], rows[7], rows[8], rows[9]
    cut = swap_chains(f, cand, (parent_r, ndev_r, state_r, ref_r), gpu, policy, pos)  # (the same choice)
    if cut is None or cut < len(cand):
        return None
    par = f[parent_r, cand]
    top = chain_tops(f, cand, par, ndev_r)
    if remember is not None:
        adapt_forget(remember[0], f[hits_r], remember[1], node_keys, cand, False)
        remember[2][0] = 1
    return drop_run(f, cand, par, top, rows[:7], reset, node_keys, kmap, devs, stack, at, ids)


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


def give_uses(f: np.ndarray, hits_row: int, nodes: np.ndarray, uses: np.ndarray, lo: int, capped: bool,
              cap: int) -> None:
    got = np.zeros(len(nodes), dtype=np.int32)
    k = max(0, min(len(nodes), len(uses) - lo))  # (keys the request grew by after its match: none)
    got[:k] = uses[lo:lo + k]
    if capped:
        np.minimum(got, cap, out=got)
    f[hits_row, nodes] = np.minimum.accumulate(got)


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
                  policy, gone: list | None, remember: tuple | None) -> tuple[int, int] | None:
    parent, child, nxt, prev, cont, state, ref, host, hits = rows
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
    if remember is not None:
        adapt_forget(remember[0], f[hits], remember[1], node_keys, cand, False)
        remember[2][0] = 1
    for v in cand[mapped].tolist():
        del kmap[node_keys[v]]
    if gone is not None:
        gone += [node_keys[v] for v in cand.tolist()]
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


def swap_chains(f: np.ndarray, cand: np.ndarray, rows: tuple, gpu: int, policy, pos: np.ndarray) -> int | None:
    """`Eviction._swap_batched`'s choice for the usual run: chain_tops, then `_first_trigger`
    (nothing parked); None where the run is not whole chains."""
    parent_r, ndev_r, state_r, ref_r = rows
    par = f[parent_r, cand]
    if (par < 0).any():
        return None
    top = chain_tops(f, cand, par, ndev_r)
    if top is None:
        return None
    counts: dict[int, int] = {}
    last: dict[int, int] = {}
    for t in top:
        p = int(par[t])
        counts[p] = counts.get(p, 0) + 1
        last[p] = t
    cut = len(cand)
    for p, c in counts.items():
        if (f[ndev_r, p] == c and f[state_r, p] == gpu and f[ref_r, p] == 0 and last[p] + 1 < cut
                and p not in policy):
            cut = last[p] + 1
    return cut


def mark_chains(f: np.ndarray, vs: np.ndarray, task: np.ndarray, hosts: np.ndarray, victims: np.ndarray,
                devs: np.ndarray, at: int, rows: tuple, swap2cpu: int, task_id: int, node_keys: list,
                victim_keys: list, gpu: int) -> list[int]:
    """mark_swap_out, then each chain top's parent loses a device child; those left unreferenced
    GPU nodes without device children, one per top."""
    ndev, parent, state, ref = rows[3], rows[4], rows[2], rows[5]
    mark_swap_out(f, vs, task, hosts, victims, devs, at, rows[:4], swap2cpu, task_id, node_keys, victim_keys)
    par = f[parent, vs]
    e = len(vs)
    outside = par[[i for i in range(e) if i == e - 1 or par[i] != vs[i + 1]]]
    np.subtract.at(f[ndev], outside, 1)
    return [int(p) for p in outside if f[ndev, p] == 0 and f[state, p] == gpu and f[ref, p] == 0]


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


# ---- the `adaptive` policy (runtime/cache/policies/adaptive.py): its state is the policy's
# arrays (M, F, R, H, T, bits, st, hits), read and written in place as the C functions do,
# one block at a time
A_CLOCK, A_SERIAL, A_RHEAD, A_RTAIL, A_HSIZE, A_NP, A_TB, A_ABOVE, A_LASTEX, A_PSER, A_ORDER, A_FSTAMP, A_NPARK, \
    A_PMAX, A_F, A_XA, A_QB = range(17)
M_RSTAMP, M_PSER, M_BSER, M_REL, M_PRIO, M_QDUE, M_ROWS = range(7)


class _Adapt:
    """The adaptive policy's arrays as the C functions see them (adapt_take), and the steps they
    share: the ledger of live exits (blocks that left the recency segment R and were not used
    since), R's ring and P's heap, and the counts by due release behind `gaps`' frontier F (the
    lowest due release at which as many evicted live exits are due then or later as queued nodes
    before it; counted from L = clock - RT/2 to L + RT - 1)."""

    def __init__(self, m, f, r, h, t, bits, st, hits, due=None):
        self.n = len(hits)
        if len(m) != M_ROWS * self.n or len(f) != 3 * self.n:
            raise ValueError("the adaptive policy's arrays do not fit together")
        self.m, self.f, self.rq, self.bits, self.st, self.hits, self.due = m, f, r, bits, st, hits, due
        self.rq_cap, self.hcap, self.rt, self.rs = len(r) // 2, len(h) // 4, len(t) // 5, len(bits)
        self.hk, self.ho, self.hn, self.hs = (h[i::4] for i in range(4))  # entries [priority, order, node, serial]
        self.tstart, self.tlen, self.talive, self.qdue, self.xdue = (t[i * self.rt:(i + 1) * self.rt] for i in range(5))

    def get(self, v: int, row: int) -> int:
        return int(self.m[v * M_ROWS + row])

    def set(self, v: int, row: int, x: int) -> None:
        self.m[v * M_ROWS + row] = x

    def tracked(self, t: int) -> bool:
        clock = int(self.st[A_CLOCK])
        if t < 0 or t >= clock or clock - t >= self.rt - 1:
            return False
        j = t % self.rt
        return int(self.st[A_SERIAL]) - int(self.tstart[j]) <= self.rs - int(self.tlen[j])

    def alive(self, t: int) -> int:
        return int(self.talive[t % self.rt]) if self.tracked(t) else 0

    def low(self) -> int:
        return max(0, int(self.st[A_CLOCK]) - self.rt // 2)

    def clamp(self, d: int) -> int:
        return min(max(d, self.low()), self.low() + self.rt - 1)

    def count(self, queued: bool, d: int, sign: int) -> None:
        """A queued node or an evicted live exit due at d (as counted) counted, or no more."""
        if d < self.low():
            return  # (gone with its column)
        (self.qdue if queued else self.xdue)[d % self.rt] += sign
        if queued and d < self.st[A_F]:
            self.st[A_QB] += sign
        elif not queued and d >= self.st[A_F]:
            self.st[A_XA] += sign

    def qin(self, v: int, span: int) -> None:
        d = self.clamp(_cdiv(self.get(v, M_PRIO), span))
        self.set(v, M_QDUE, d)
        self.count(True, d, 1)

    def qout(self, v: int) -> None:
        d = self.get(v, M_QDUE)
        if d >= 0:
            self.set(v, M_QDUE, -1)
            self.count(True, d, -1)

    def xout(self, s: int) -> None:
        if self.bits[s % self.rs] & 2:
            self.bits[s % self.rs] &= ~np.uint8(2)
            self.count(False, int(self.due[s % self.rs]), -1)

    def evicted(self, v: int, span: int) -> None:
        """Node v leaves the cache: a live exit with a bonus is counted at its due release."""
        pr, t, s = self.get(v, M_PRIO), self.get(v, M_REL), self.get(v, M_BSER) % self.rs
        if pr <= t * span + pr % span or not self.f[3 * v] or not self.bits[s] & 1 or not self.tracked(t):
            return
        self.due[s] = self.clamp(_cdiv(pr, span))
        self.bits[s] |= 2
        self.count(False, int(self.due[s]), 1)

    def advance(self, low: int) -> None:
        """The clock moved on from a release whose L was `low`: older due releases go."""
        st = self.st
        for d in range(low, self.low()):
            j = d % self.rt
            if st[A_F] <= d:
                st[A_F] = d + 1
                st[A_XA] -= self.xdue[j]
            else:
                st[A_QB] -= self.qdue[j]
            self.qdue[j] = self.xdue[j] = 0

    def frontier(self) -> None:
        st, low = self.st, self.low()
        while st[A_XA] > st[A_QB] and st[A_F] < low + self.rt - 1:
            j = int(st[A_F]) % self.rt
            st[A_XA] -= self.xdue[j]
            st[A_QB] += self.qdue[j]
            st[A_F] += 1
        while st[A_F] > low:
            j = int(st[A_F] - 1) % self.rt
            if st[A_XA] + self.xdue[j] > st[A_QB] - self.qdue[j]:
                break
            st[A_F] -= 1
            st[A_XA] += self.xdue[j]
            st[A_QB] -= self.qdue[j]

    def fix(self) -> None:
        st = self.st
        held = int(st[A_NP] + st[A_NPARK])
        while st[A_TB] <= st[A_LASTEX] and st[A_ABOVE] - self.alive(int(st[A_TB])) >= held:
            st[A_ABOVE] -= self.alive(int(st[A_TB]))
            st[A_TB] += 1
        low = int(st[A_CLOCK]) - self.rt + 2
        while st[A_ABOVE] < held and st[A_TB] > low and st[A_TB] > 0:
            st[A_TB] -= 1
            st[A_ABOVE] += self.alive(int(st[A_TB]))

    def window(self) -> tuple[int, int] | None:
        """What an LRU cache of the same size holds beyond R when a request is matched: every
        live exit of releases after TB and those of release TB from the block serial returned on
        (None: nothing)."""
        st = self.st
        held = int(st[A_NP] + st[A_NPARK])
        tb = int(st[A_TB])
        if not held:
            return None
        start = 1 << 63
        if self.tracked(tb):
            need = held - (int(st[A_ABOVE]) - self.alive(tb))
            j = tb % self.rt
            for x in range(int(self.tstart[j] + self.tlen[j]) - 1, int(self.tstart[j]) - 1, -1):
                if need <= 0:
                    break
                if self.bits[x % self.rs]:
                    need -= 1
                    start = x
        return tb, start

    @staticmethod
    def in_lru(w: tuple[int, int] | None, t: int, s: int) -> bool:
        return w is not None and (t > w[0] or (t == w[0] and s >= w[1]))

    def exit(self, v: int) -> None:
        t, s = self.get(v, M_REL), self.get(v, M_BSER)
        if t > self.st[A_LASTEX]:
            self.st[A_LASTEX] = t
        if self.f[3 * v] or not self.tracked(t):
            return
        self.f[3 * v] = 1
        self.bits[s % self.rs] = 1
        self.talive[t % self.rt] += 1
        if t >= self.st[A_TB]:
            self.st[A_ABOVE] += 1

    def dies(self, t: int, s: int) -> None:
        if not self.tracked(t) or not self.bits[s % self.rs]:
            return
        self.xout(s)
        self.bits[s % self.rs] = 0
        self.talive[t % self.rt] -= 1
        if t >= self.st[A_TB]:
            self.st[A_ABOVE] -= 1

    def reenter(self, v: int) -> None:
        if self.f[3 * v + 2]:
            self.f[3 * v + 2] = 0
            self.st[A_NPARK] -= 1
        if self.f[3 * v]:
            self.f[3 * v] = 0
            self.dies(self.get(v, M_REL), self.get(v, M_BSER))

    # P's heap: [priority, order, node, serial] entries, lowest (priority, order) on top
    def less(self, i: int, j: int) -> bool:
        return (self.hk[i], self.ho[i]) < (self.hk[j], self.ho[j])

    def swap(self, i: int, j: int) -> None:
        for row in (self.hk, self.ho, self.hn, self.hs):
            row[i], row[j] = row[j], row[i]

    def down(self, i: int, size: int) -> None:
        while True:
            low, m = 2 * i + 1, i
            if low < size and self.less(low, m):
                m = low
            if low + 1 < size and self.less(low + 1, m):
                m = low + 1
            if m == i:
                return
            self.swap(i, m)
            i = m

    def remove_top(self) -> None:
        self.st[A_HSIZE] -= 1
        size = int(self.st[A_HSIZE])
        if size:
            for row in (self.hk, self.ho, self.hn, self.hs):
                row[0] = row[size]
            self.down(0, size)

    def ptop(self) -> int:
        while self.st[A_HSIZE]:
            if self.get(int(self.hn[0]), M_PSER) == self.hs[0]:
                return 0
            self.remove_top()
        return -1

    def protect(self, v: int) -> None:
        st = self.st
        if st[A_HSIZE] == self.hcap:  # full of stale entries: keep the live ones, heapified again
            live = [i for i in range(self.hcap) if self.get(int(self.hn[i]), M_PSER) == self.hs[i]]
            for row in (self.hk, self.ho, self.hn, self.hs):
                row[:len(live)] = row[live]
            st[A_HSIZE] = len(live)
            for i in reversed(range(len(live) // 2)):
                self.down(i, len(live))
        i = int(st[A_HSIZE])
        st[A_HSIZE] += 1
        ser = int(st[A_PSER])
        st[A_PSER] += 1
        prio = self.get(v, M_PRIO)
        st[A_PMAX] = max(int(st[A_PMAX]), prio)
        self.hk[i], self.ho[i], self.hn[i], self.hs[i] = prio, st[A_ORDER], v, ser
        st[A_ORDER] += 1
        self.set(v, M_PSER, ser)
        while i > 0 and self.less(i, (i - 1) // 2):
            self.swap(i, (i - 1) // 2)
            i = (i - 1) // 2
        st[A_NP] += 1

    def unprotect_top(self) -> int:
        v = int(self.hn[0])
        self.set(v, M_PSER, -1)
        self.remove_top()
        self.st[A_NP] -= 1
        return v

    # R's ring of [node, stamp] entries, oldest at RHEAD
    def live_entry(self, x: int) -> tuple[int, int] | None:
        j = x % self.rq_cap
        v, s = int(self.rq[2 * j]), int(self.rq[2 * j + 1])
        return (v, s) if 0 <= v < self.n and self.get(v, M_RSTAMP) == s else None

    def rhead(self) -> int:
        st = self.st
        while st[A_RHEAD] < st[A_RTAIL]:
            e = self.live_entry(int(st[A_RHEAD]))
            if e is not None:
                return e[0]
            st[A_RHEAD] += 1
        return -1

    def rroom(self) -> None:
        st = self.st
        if st[A_RTAIL] - st[A_RHEAD] < self.rq_cap:
            return
        live = [e for e in map(self.live_entry, range(int(st[A_RHEAD]), int(st[A_RTAIL]))) if e is not None]
        for w, (v, s) in enumerate(live):
            k = (int(st[A_RHEAD]) + w) % self.rq_cap
            self.rq[2 * k], self.rq[2 * k + 1] = v, s
        st[A_RTAIL] = st[A_RHEAD] + len(live)


def adapt_push(m, f, r, h, t, bits, st, hits, nodes, levels, hold, unit, far1, far2, span, ghost, due) -> None:
    a = _Adapt(m, f, r, h, t, bits, st, hits, due)
    if len(ghost) != a.n or len(due) != a.rs:
        raise ValueError("adapt_push: one last gap per node, one due release per block serial")
    if len(nodes) and not (0 <= nodes.min() and nodes.max() < a.n):
        raise IndexError("adapt_push: node id out of range")
    if not len(levels) or not len(hold) or span < 1 or len(nodes) >= a.rs // 2:
        raise ValueError("adapt_push: no levels, or a release larger than the ring of serials")
    now, s0, k = int(st[A_CLOCK]), int(st[A_SERIAL]), len(nodes)
    j = now % a.rt
    a.tstart[j], a.tlen[j], a.talive[j] = s0, k, 0
    for s in range(s0, s0 + k):
        a.xout(s)
    bits[np.arange(s0, s0 + k) % a.rs] = 0
    low = a.low()
    st[A_CLOCK], st[A_SERIAL] = now + 1, s0 + k
    a.advance(low)
    if st[A_TB] < now + 2 - a.rt or (st[A_TB] < now and not a.tracked(int(st[A_TB]))):
        tb = int(st[A_TB])
        while tb < now and not a.tracked(tb):
            tb += 1
        st[A_TB] = tb
        st[A_ABOVE] = sum(a.alive(x) for x in range(tb, now + 1))
    for i, v in enumerate(nodes.tolist()):
        a.qout(v)
        if a.get(v, M_PSER) >= 0:  # queued in P: out of it, used again
            a.set(v, M_PSER, -1)
            st[A_NP] -= 1
            a.reenter(v)
        f[3 * v] = 0
        if f[3 * v + 2]:
            f[3 * v + 2] = 0
            st[A_NPARK] -= 1
        uses = max(0, int(hits[v]))
        u = min(uses, len(hold) - 1)
        hd = float(hold[u])
        gap = int(ghost[v])
        if (u == 1 and gap > far1) or (u == 2 and gap > far2):
            hd = 0.0
        due = now + (int(unit * hd) if unit > 0 else 0)
        a.set(v, M_PRIO, due * span + int(levels[min(uses, len(levels) - 1)]))
        a.qin(v, span)
        ghost[v] = -1
        a.set(v, M_REL, now)
        a.set(v, M_BSER, s0 + i)
        a.set(v, M_RSTAMP, s0 + i)
        a.rroom()
        q = int(st[A_RTAIL]) % a.rq_cap
        st[A_RTAIL] += 1
        r[2 * q], r[2 * q + 1] = v, s0 + i
    a.fix()
    a.frontier()


def adapt_front(m, f, r, h, t, bits, st, hits, nodes, span, due) -> None:
    a = _Adapt(m, f, r, h, t, bits, st, hits, due)
    if len(due) != a.rs or span < 1:
        raise ValueError("adapt_front: one due release per block serial of the ring, span >= 1")
    for v in reversed(nodes.tolist()):
        a.reenter(v)
        a.rroom()
        s = int(st[A_FSTAMP])
        st[A_FSTAMP] += 1
        st[A_RHEAD] -= 1
        q = int(st[A_RHEAD]) % a.rq_cap
        r[2 * q], r[2 * q + 1] = v, s
        a.set(v, M_RSTAMP, s)
        a.qout(v)
        a.qin(v, span)
    a.fix()
    a.frontier()


def adapt_discard(m, f, r, h, t, bits, st, hits, nodes, turnover, due) -> tuple[int, int, int, int]:
    a = _Adapt(m, f, r, h, t, bits, st, hits, due)
    if len(due) != a.rs:
        raise ValueError("adapt_discard: one due release per block serial of the ring")
    queued = long = gains = lead = 0
    w = a.window()  # LRU's content as the request found it
    vs = nodes.tolist()
    for v in vs:
        lru = bool(f[3 * v]) and a.in_lru(w, a.get(v, M_REL), a.get(v, M_BSER))
        gains += bool(f[3 * v]) and not lru
        if a.get(v, M_QDUE) >= 0:  # queued: would `gaps`' order (due at F or later), would LRU hold it?
            lead += int(a.get(v, M_QDUE) >= st[A_F]) - int(lru or a.get(v, M_RSTAMP) >= 0)
    for v in vs:
        in_p = a.get(v, M_PSER) >= 0
        if in_p or a.get(v, M_RSTAMP) >= 0:
            queued += 1
            long += float(st[A_CLOCK] - a.get(v, M_REL)) > turnover
        a.qout(v)
        a.reenter(v)
        if in_p:
            a.set(v, M_PSER, -1)
            st[A_NP] -= 1
        a.set(v, M_RSTAMP, -1)
    a.fix()
    a.frontier()
    return queued, long, gains, lead


def adapt_missed(m, f, r, h, t, bits, st, hits, ages, depth, due) -> tuple[int, int, int]:
    a = _Adapt(m, f, r, h, t, bits, st, hits, due)
    if len(due) != a.rs:
        raise ValueError("adapt_missed: one due release per block serial of the ring")
    clock = int(st[A_CLOCK])
    losses = lead = 0
    w = a.window()  # LRU's content as the request found it
    dead = []
    for j, age in enumerate(ages.tolist()):
        if age < 0:
            continue
        rel = clock - age
        if not a.tracked(rel):
            continue
        x = rel % a.rt
        if depth + j >= a.tlen[x]:
            continue
        s = int(a.tstart[x] + a.tlen[x]) - 1 - (depth + j)  # released deepest first
        b = int(bits[s % a.rs])
        if not b:
            continue
        lru = a.in_lru(w, rel, s)
        losses += lru
        # would `gaps`' order have held it (evicted with a bonus due at F or later), would LRU?
        lead += int(bool(b & 2) and int(due[s % a.rs]) >= st[A_F]) - int(lru)
        dead.append((rel, s))
    for rel, s in dead:
        a.dies(rel, s)
    a.fix()
    a.frontier()
    known = np.nonzero(np.asarray(ages) >= 0)[0]
    return losses, lead, int(known[-1]) + 1 if len(known) else 0


def _cdiv(x: int, y: int) -> int:
    """C's integer division (toward zero)."""
    q = abs(x) // abs(y)
    return q if (x >= 0) == (y > 0) else -q


def adapt_pop(m, f, r, h, t, bits, st, hits, out, k, budget, span, fm, parent_row, ndev_row, child_row, next_row,
              scratch, due) -> int:
    a = _Adapt(m, f, r, h, t, bits, st, hits, due)
    if len(due) != a.rs:
        raise ValueError("adapt_pop: one due release per block serial of the ring")
    if k < 0 or k > len(out) or span < 1 or fm.shape[1] != a.n or len(scratch) != a.n:
        raise ValueError("adapt_pop: need room for k nodes in out, span >= 1, and a node matrix and scratch of n columns")
    parent, ndev = fm[parent_row], fm[ndev_row]
    child, nxt = (fm[child_row], fm[next_row]) if child_row >= 0 else (None, None)
    taken = held = 0
    stop = False  # the last victim left its parent, not queued, without device children (or any: host tier)

    def all_taken(p: int) -> bool:  # p has no children but the scratch[p] taken so far
        seen, c = 0, int(child[p])
        while 0 <= c < a.n:
            seen += 1
            if seen > scratch[p]:
                return False
            c = int(nxt[c])
        return True

    def victim(v: int) -> None:
        nonlocal taken, held, stop
        parked = ndev[v] > scratch[v]
        a.qout(v)
        if parked and held < 1028:  # a device child left: P keeps it, ranked last (1028 per victim)
            held += 1
            a.set(v, M_PRIO, int(st[A_PMAX]))
            a.protect(v)
            a.qin(v, span)
            return
        held = 0
        out[taken] = v
        taken += 1
        if parked:
            f[3 * v + 2] = 1
            st[A_NPARK] += 1
            return
        a.evicted(v, span)
        if 0 <= parent[v] < a.n:
            p = int(parent[v])
            scratch[p] += 1
            stop = bool(a.get(p, M_RSTAMP) < 0 and a.get(p, M_PSER) < 0
                        and (scratch[p] == ndev[p] or (child is not None and all_taken(p))))

    while taken < k and not stop:
        p = a.ptop()
        if p >= 0 and st[A_NP] > budget:
            victim(a.unprotect_top())
            a.fix()
            continue
        v = a.rhead()
        if v < 0:
            if p < 0:
                break
            victim(a.unprotect_top())
            a.fix()
            continue
        pr = a.get(v, M_PRIO)
        base = a.get(v, M_REL) * span + pr % span
        if pr > base:  # a bonus: P keeps it if it has room, or once its lowest is gone
            if st[A_NP] < budget:
                st[A_RHEAD] += 1
                a.set(v, M_RSTAMP, -1)
                a.exit(v)
                a.protect(v)
                a.fix()
                continue
            if p >= 0 and a.hk[0] < pr:
                victim(a.unprotect_top())
                a.fix()
                continue
        elif p >= 0 and a.hk[0] < base:
            victim(a.unprotect_top())
            a.fix()
            continue
        st[A_RHEAD] += 1
        a.set(v, M_RSTAMP, -1)
        a.exit(v)
        victim(v)
        a.fix()
    for v in out[:taken].tolist():
        scratch[v] = 0
        if 0 <= parent[v] < a.n:
            scratch[parent[v]] = 0
    a.fix()
    a.frontier()
    return taken


# the adaptive policy's memory of blocks gone from the cache: two slots per 16-byte key, each a
# record of its release (bits 0-31), uses (32-39, saturating), tag (40-47: the key's 9th byte)
# and a written bit (48)
def _gslots(key: bytes, mask: int) -> tuple[int, int]:
    h = int.from_bytes(key[:8], sys.byteorder)
    return h & mask, (h >> 32) & mask


def adapt_forget(m, hits, table, keys, nodes, aligned) -> None:
    slots = len(table) // 2
    n = len(m) // M_ROWS
    if len(keys) != (len(nodes) if aligned else n) or len(hits) != len(keys) or slots < 1 or slots & (slots - 1):
        raise ValueError("adapt_forget: a key per node (or per node id), and a table of 2 rows of 2**k slots")
    for i, v in enumerate(nodes.tolist()):
        if not 0 <= v < n:
            continue
        key = keys[i if aligned else v]
        if not isinstance(key, bytes) or len(key) != 16:
            continue  # (not a block key: nothing to remember)
        uses = min(255, max(0, int(hits[i if aligned else v])) + 1)
        rec = (int(m[v * M_ROWS + M_REL]) & 0xffffffff) | uses << 32 | key[8] << 40 | 1 << 48
        a, b = _gslots(key, slots - 1)
        table[a] = rec
        table[slots + b] = rec


def adapt_recall(table, keys, start, clock, ages, uses) -> None:
    slots = len(table) // 2
    k = len(keys) - start
    if start < 0 or k < 0 or len(ages) < k or len(uses) != len(ages) or slots < 1 or slots & (slots - 1):
        raise ValueError("adapt_recall: room for every key from start, a table of 2 rows of 2**k slots")
    for i in range(k):
        key = keys[start + i]
        ages[i], uses[i] = -1, 0
        if not isinstance(key, bytes) or len(key) != 16:
            continue
        a, b = _gslots(key, slots - 1)
        newest, best = -1, 0
        for rec in (int(table[a]), int(table[slots + b])):
            if not rec >> 48 & 1 or (rec >> 40) & 0xff != key[8]:
                continue
            when = (clock & ~0xffffffff) | (rec & 0xffffffff)  # the latest release with these low bits
            if when > clock:
                when -= 1 << 32
            if when > newest:
                newest, best = when, rec
        if newest >= 0:
            ages[i], uses[i] = clock - newest, (best >> 32) & 0xff
