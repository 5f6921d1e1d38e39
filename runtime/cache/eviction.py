"""Device block allocation and eviction for the prefix cache.

Device eviction frees only what is missing (`need - free`, counting device blocks that
in-flight swap-outs will return), takes victims in the order of the eviction policy (LRU over
leaves by default, runtime/cache/policies/lru.py, behind runtime/cache/policies/base.py), swaps them to host blocks
when there are any (evicting host leaves to make room), else drops them, and recycles freed
blocks in one batch. Nothing is evicted for an allocation that would fail anyway.

Without a host tier, victims are dropped a run at a time (`_drop_batched`): the policy hands out
the next nodes (`pop_many`), and a run of chains released deepest first, whose drop queues no
parent ahead of the rest of the run, is freed in one C call (runtime/cache/_cache_core.c
drop_chains: the chain check, the cut, the policy's memory of the keys that leave and the node
surgery), any other run by the general path (the same steps, a call each, with Python between);
the victims, their order and every field written are those of popping and dropping one node at
a time (tests/runtime/cache/test_eviction_policies.py compares both). With a host tier, victims are swapped out a run at a time the same way
(`_swap_batched`): the run is chosen as above, its host blocks are taken (free ones, then host
leaves dropped a run at a time, `_drop_host_run`), and its nodes are marked SWAP2CPU; each of
those steps is one C call (runtime/cache/_cache_core.c drop_host_run, drop_host_nodes and
free_host_nodes, mark_swap_out; for the usual run, whole chains, the choice is swap_chains and
the marking, with the device children the chains' tops take from their parents, mark_chains;
tests/runtime/cache/test_cache_core.py checks them against the numpy code they replaced, and
the usual run's calls against the general path). The victims' ids, device and host blocks are int32 arrays from the
start (the swap-out task carries them as they are): at a couple of hundred victims per request,
a Python int and a list append per block on each side of the swap were a good share of the
host tier's cost. Once the host tier runs out, the rest is dropped one victim at a time
(`_drop_one_by_one`): with a host tier a victim may have host-only children (its whole subtree
goes with it) and a parent on the host only (which becomes a host leaf), which the batched drop
does not handle; and the host tier runs out only when no host block is free or held by an
evictable host leaf, which is rare.
"""
from __future__ import annotations

import logging

import numpy as np

from kvrt.ipc.protocol import TaskKind

from kvrt.runtime.cache.core import (chain_tops as _chain_tops_c, drop_chains as _drop_chains_c,
                                    drop_host_nodes as _drop_host_nodes_c,
                                    drop_host_run as _drop_host_run_c, drop_run as _drop_run_c,
                                    free_host_nodes as _free_host_nodes_c, mark_chains as _mark_chains_c,
                                    mark_swap_out as _mark_swap_out_c, swap_chains as _swap_chains_c)
from kvrt.runtime.cache.nodes import (CHILD, CONT, CPU, DEV, FREE, GPU, HITS, HOST, NDEV, NEXT, ON_DEVICE, ON_HOST,
                          PARENT, PREV, REF, RESET, STATE, SWAP2CPU, NodeStore)

log = logging.getLogger(__name__)

# the node matrix rows runtime/cache/_cache_core.c's drop_run reads and writes, in its order; the
# values a freed node's column is reset to
DROP_ROWS = (PARENT, CHILD, NEXT, PREV, CONT, NDEV, DEV)
# and those drop_chains reads besides (a parent's state and references, the uses remembered)
CHAIN_DROP_ROWS = DROP_ROWS + (STATE, REF, HITS)
RESET_ROW = tuple(RESET.tolist())
# the rows drop_host_run and mark_swap_out read and write, in their order
HOST_DROP_ROWS = (PARENT, CHILD, NEXT, PREV, CONT, STATE, REF, HOST, HITS)  # drop_host_nodes: the first 7
SWAP_OUT_ROWS = (HOST, DEV, STATE, NDEV)
# those swap_chains reads, and those mark_chains reads and writes
SWAP_CHAIN_ROWS = (PARENT, NDEV, STATE, REF)
MARK_CHAIN_ROWS = SWAP_OUT_ROWS + (PARENT, REF)


class Eviction(NodeStore):
    """Allocation with eviction, mixed into PrefixCache (it uses the pools, the metrics and the
    task bookkeeping of runtime/cache/tasks.py through the same object)."""

    def _take_device(self, n: int, urgent: bool = False) -> list[int] | None:
        """`n` free device blocks, evicting only what is missing; None if not possible now.
        Deferred swap-ins come first unless `urgent`. Nothing is evicted when free, returning
        and evictable blocks together cannot cover the need: that allocation fails anyway."""
        pool = self.device_pool
        if not urgent:
            self._start_deferred()
        ahead = 0 if urgent else self._deferred_need
        short = n + ahead - pool.num_free
        if short > 0:
            short -= self._dev_returning
            if short > self._idle:
                return None
            if short > 0:
                self._evict_device(short)
            if pool.num_free < n + ahead:
                self._start_deferred()
                return None
        got = pool.allocate(n)
        self._start_deferred()
        return got

    def _swap_ahead(self) -> None:
        """With a host tier, keep a few device blocks free or on their way back: a swap-out
        takes a round trip to the cache-transfer ranks, and a request that needs a block
        should not wait for one (nor anyone be preempted) while it is under way."""
        if not self.host_pool.num_blocks:
            return
        short = self._low_water - self.device_pool.num_free - self._dev_returning - self._deferred_need
        if short > 0 and self._idle:
            self._evict_device(min(short, self._idle))

    def _evict_device(self, n: int) -> None:
        """Evict up to `n` device blocks, in the policy's order (leaves only), a run at a time:
        to host blocks (a SWAP2CPU task) while any can be had, else dropped."""
        dropped: list[int] = []
        if not self.host_pool.num_blocks:
            evicted = self._drop_batched(n, dropped)
            self._finish_eviction(dropped, [], [], [], [], evicted, -1, ([], []))
            return
        # the victims' host blocks, in the order they take them: free ones first, in one batch,
        # then those of host leaves evicted as needed; their ids and device blocks alongside (int32
        # arrays: no Python object per victim, and the swap-out task carries them as they are)
        k = min(n, self.host_pool.num_free)
        hosts = np.empty(n, dtype=np.int32)
        if k:
            hosts[:k] = self.host_pool.allocate(k)
        victims = np.empty(n, dtype=np.int32)
        devs = np.empty(n, dtype=np.int32)
        victim_keys: list[bytes] = []  # taken now: a victim may be detached before the end
        swapped, have, rest, task_id = self._swap_batched(n, hosts, k, victims, devs, victim_keys)
        evicted = swapped
        freed_hosts: list[int] = []
        if rest is not None:  # the host tier ran out
            evicted += self._drop_one_by_one(n - evicted, dropped, freed_hosts, rest)
        # host blocks taken but not used go back as the list held them (last taken first)
        unused = hosts[swapped:have][::-1].tolist()
        self._finish_eviction(dropped, freed_hosts, unused, victims[:swapped], victim_keys, evicted, task_id,
                              (devs[:swapped], hosts[:swapped]))

    def _drop_one_by_one(self, n: int, dropped: list[int], freed_hosts: list[int], first: list[int] = ()) -> int:
        """Drop up to `n` device leaves popped one at a time, once the host tier ran out; returns
        how many. Not batched: with a host tier a victim may have host-only children (it goes
        with its subtree) and a parent on the host only (it becomes a host leaf), and this runs
        only when no host block is free or held by an evictable host leaf, which is rare.
        `first`: victims already popped (the rest of a run the host tier could not take), in
        order, before any popped now; a drop that queues its parent (next in line) sends those
        still waiting back behind it."""
        policy = self._dev_lru
        pop = policy.pop
        ndev, child, wanted_back, parent = self._ndev_v, self._child_v, self._wanted_back, self._parent_v
        waiting = list(first)
        self._handed_out = set(waiting)
        try:
            return self._drop_each(n, dropped, freed_hosts, waiting)
        finally:
            self._handed_out = frozenset()

    def _drop_each(self, n: int, dropped: list[int], freed_hosts: list[int], waiting: list[int]) -> int:
        """`_drop_one_by_one`'s loop: `waiting` first, then what the policy pops."""
        policy = self._dev_lru
        pop = policy.pop
        ndev, child, wanted_back, parent = self._ndev_v, self._child_v, self._wanted_back, self._parent_v
        evicted = 0
        while evicted < n:
            if waiting:
                v = waiting.pop(0)
                self._handed_out.discard(v)
            else:
                v = pop()
            if v < 0:
                break
            if ndev[v]:
                continue  # parked: requeued when its last device child leaves
            if v in wanted_back:
                continue  # parked: a swap-out still reads its block; requeued when it answers
            evicted += 1
            p = int(parent[v])
            queued = p >= 0 and p in policy
            if child[v] < 0:
                self._drop_leaf(v, dropped)
            else:
                self._drop_subtree(v, dropped, freed_hosts)
            if waiting and p >= 0 and not queued and p in policy:  # next in line: the rest behind it
                self._requeue_behind(p, waiting)
                waiting.clear()
                self._handed_out.clear()
        if waiting:  # (a run never holds more victims than asked for)
            policy.push_front_run(waiting)
        return evicted

    def _requeue_behind(self, p: int, nodes: list[int]) -> None:
        """`p` was just queued at the front; popped `nodes` go back right behind it."""
        policy = self._dev_lru
        policy.discard_one(p)
        policy.push_front_run(nodes)
        policy.push_front(p)

    def _drop_batched(self, n: int, devs: list[int]) -> int:
        """Drop up to `n` device leaves (no host tier), exactly as popping and dropping them one
        at a time would, but a run of victims at a time: the policy hands out the next nodes
        (`pop_many`), and whole chains are freed with a few array operations, with Python work
        only per chain top and per non-continuation key. Returns how many were dropped.

        A popped node is evictable if its device children all come before it in the run and
        are evictable themselves (popping one at a time would have dropped them first); the
        others are parked, as `pop` parks them. One-at-a-time eviction would put a parent that
        becomes an unqueued evictable leaf (`push_front`) next in line: the run is cut after the
        node that frees it, and the rest of the run goes back to the front of the queue behind
        that parent."""
        f = self._f
        policy = self._dev_lru
        evicted = 0
        # the usual run in one C call (drop_chains: whole chains, nothing cut, the keys remembered
        # as `forget` would); an observer is told of each key from Python, and a policy that
        # remembers only through `forget` takes the general path below
        remember = policy.remember_into() if self._remembers else None
        whole = self._obs is None and (remember is not None or not self._remembers)
        while evicted < n:
            cand = policy.pop_many(n - evicted)
            m = len(cand)
            if not m:
                break
            if whole:
                freed = _drop_chains_c(f, cand, CHAIN_DROP_ROWS, RESET_ROW, self._keys, self._map, devs, self._stack,
                                       self._top, self.device_pool.ids, policy, GPU, self._pos_scratch, remember)
                if freed is not None:
                    self._dropped(m, freed)
                    evicted += m
                    continue
            par = f[PARENT].take(cand)
            top = self._chain_tops(cand, par)
            if top is not None:
                # the usual run: chains released deepest first, each node's only device child
                # right before it; all go, and only each chain's top has a parent that stays
                ev = None
            else:
                ev, top = self._evictable(cand, par, f[NDEV, cand])
            cut = self._first_trigger(cand, par, top, ev is not None and not ev.all())
            if cut < m:
                policy.push_front_run(cand[cut:].tolist())
                if ev is None:  # whole chains: the cut (after a chain's top) splits none
                    top = [t for t in top if t < cut]
                    ev = np.zeros(m, dtype=bool)
                    ev[:cut] = True
                else:  # a node whose parent was to go later in the run is now a top too
                    ev[cut:] = False
                    top = self._tops(cand[:cut], par[:cut], ev[:cut])
            if ev is None:
                self._drop_run(cand, par, top, devs)
                evicted += m
            elif ev.any():
                at = np.flatnonzero(ev)
                self._drop_run(cand[at], par[at], np.searchsorted(at, top).tolist(), devs)
                evicted += len(at)
        return evicted

    def _swap_batched(self, n: int, hosts: np.ndarray, have: int, victims: np.ndarray, devs: np.ndarray,
                      victim_keys: list[bytes]) -> tuple[int, int, list[int] | None, int]:
        """Start swapping out up to `n` device leaves (host tier), exactly as the per-victim loop
        of `_evict_device` would, a run at a time: the run's victims are chosen as
        `_drop_batched` chooses them (a node wanted back is parked too), get their host blocks
        (`hosts`, the first `have` of them already there: free ones; then `_take_host` adds
        those of the host leaves it drops), in order, and are marked in one C call, their ids,
        device blocks and keys going to `victims`, `devs` and `victim_keys`. Choosing victims reads only device-side fields and taking host
        leaves writes only host-side ones, so taking a run's host blocks before marking its
        victims changes nothing. When the host tier runs out, the run's victims without a host
        block are `_drop_one_by_one`'s first ones, as popped (a policy whose pop moves other
        nodes, `adaptive`, cannot be undone by queueing them again). Returns how many were
        evicted (each took the next host block), how many host blocks `hosts` holds now, the
        victims left to drop once the host tier ran out (None while host blocks are still to be
        had), and the swap-out's task id (-1 if none)."""
        f = self._f
        policy = self._dev_lru
        wanted = self._wanted_back
        evicted = 0
        task_id = -1
        while evicted < n:
            if wanted:
                policy.parks(list(wanted))
            cand = policy.pop_many(n - evicted)
            m = len(cand)
            if not m:
                break
            nd = None
            if wanted:
                back = np.fromiter((v in wanted for v in cand.tolist()), dtype=bool, count=m)
                if back.any():
                    nd = f[NDEV, cand]
                    nd[back] = m + 1  # never evictable in this run: parked as `pop` parks it
            # the usual run (whole chains, each node's only device child right before it): how
            # much of it goes, in one C call (chain_tops and `_first_trigger` in one)
            cut = None if nd is not None else _swap_chains_c(f, cand, SWAP_CHAIN_ROWS, GPU, policy,
                                                             self._pos_scratch)
            if cut is not None:
                ev = par = None
                at: np.ndarray | slice = slice(0, cut)
                e = cut
            else:
                par = f[PARENT].take(cand)
                ev, top = self._evictable(cand, par, f[NDEV, cand] if nd is None else nd)
                cut = self._first_trigger(cand, par, top, not ev.all())
                at = np.flatnonzero(ev[:cut])
                e = len(at)
            want = e
            if e > have - evicted:  # free host blocks first, in the order pop() hands them out
                have += self._take_host(e - (have - evicted), hosts, have)
                e = min(e, have - evicted)
            short = e < want
            rest: list[int] = []
            if short:  # the host tier ran out: the rest is dropped one at a time
                cut = e if ev is None else int(at[e])
                at = slice(0, e) if ev is None else at[:e]
                rest = cand[cut:].tolist()  # as popped: a policy's pop may not be undone
            elif cut < m:
                policy.push_front_run(cand[cut:].tolist())
            if e:
                if task_id < 0:
                    task_id = next(self._task_ids)
                last = int(f[PARENT, cand[cut - 1]]) if short and cut else -1
                queued = last >= 0 and last in policy
                self._handed_out = set(rest)
                try:
                    if ev is None:
                        self._mark_chains(cand[at], hosts, evicted, task_id, victims, devs, victim_keys)
                    else:
                        self._mark_swap_out(cand[at], par[at], hosts, evicted, e, task_id, victims, devs, victim_keys)
                finally:
                    self._handed_out = frozenset()
                evicted += e
                if rest and last >= 0 and not queued and last in policy:  # queued next: the rest behind it
                    self._requeue_behind(last, rest)
                    rest = []
            if short:
                return evicted, have, rest, task_id
        return evicted, have, None, task_id

    def _mark_chains(self, vs: np.ndarray, hosts: np.ndarray, at: int, task_id: int, victims: np.ndarray,
                     devs: np.ndarray, victim_keys: list[bytes]) -> None:
        """`_mark_swap_out` for victims `vs` that are whole chains released deepest first, or
        the start of such a run: the marking, and the device children the chains' tops take
        from their parents, in one C call (runtime/cache/_cache_core.c mark_chains)."""
        e = len(vs)
        self._host_cached += e
        self._idle -= e
        lru = self._dev_lru
        for p in _mark_chains_c(self._f, vs, self._task, hosts, victims, devs, at, MARK_CHAIN_ROWS, SWAP2CPU, task_id,
                                self._keys, victim_keys, GPU):
            if p not in lru and p not in self._handed_out:  # at most the last victim's parent
                lru.push_front(p)

    def _mark_swap_out(self, vs: np.ndarray, par: np.ndarray, hosts: np.ndarray, at: int, e: int, task_id: int,
                       victims: np.ndarray, devs: np.ndarray, victim_keys: list[bytes]) -> None:
        """Make the `e` nodes `vs` (in eviction order, their parents `par`) SWAP2CPU in task
        `task_id`, each with the next host block of `hosts` (from index `at`), and queue a
        parent that becomes an unqueued evictable device leaf at the front. Their ids and device
        blocks go to `victims` and `devs` from index `at`, their keys to `victim_keys`."""
        self._host_cached += e
        self._idle -= e
        # one C call: host blocks, device blocks, state, task, keys and device children per victim
        _mark_swap_out_c(self._f, vs, self._task, hosts, victims, devs, at, SWAP_OUT_ROWS, SWAP2CPU, task_id,
                         self._keys, victim_keys)
        # each victim's device children went before it: none is left; only parents outside the
        # run (the chains' tops') lose device children that stay
        pos = self._pos_scratch
        pos[vs] = 0
        outside = par[pos[par] < 0].tolist()
        pos[vs] = -1
        ndev, state, ref, lru = self._ndev_v, self._state_v, self._ref_v, self._dev_lru
        for p in outside:
            ndev[p] -= 1
        for p in outside:  # at most the last victim's parent qualifies: the run is cut there
            if ndev[p] == 0 and state[p] == GPU and ref[p] == 0 and p not in lru and p not in self._handed_out:
                lru.push_front(p)

    def _chain_tops(self, cand: np.ndarray, par: np.ndarray) -> list[int] | None:
        """Is the run `cand` (parents `par`) whole chains released deepest first, each node's
        only device child right before it? Then the indices of the chains' tops (whose parent
        is not the next node; the last node always), else None. One C call."""
        return _chain_tops_c(self._f, cand, par, NDEV)

    def _evictable(self, cand: np.ndarray, par: np.ndarray, nd: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """Which nodes of a run go (every device child comes earlier in the run and goes too;
        the others are parked) and the indices of those whose parent stays (the tops)."""
        m = len(cand)
        idx = np.arange(m, dtype=np.int32)
        pos = self._pos_scratch
        pos[cand] = idx
        q = pos[par]        # where each node's parent is in the run, -1 if not in it
        pos[cand] = -1
        below = q > idx     # a child of a later node of the run
        ev = nd == np.bincount(q[below], minlength=m) if below.any() else nd == 0
        if not ev.all():
            up = q.tolist()  # parked: so are its ancestors in the run (each visited once)
            for j in np.flatnonzero(~ev).tolist():
                while True:
                    k = up[j]
                    if k <= j or not ev[k]:
                        break
                    ev[k] = False
                    j = k
        inner = below.copy()
        inner[below] = ev[q[below]]   # the parent goes in this run too
        return ev, np.flatnonzero(ev & ~inner).tolist()

    def _tops(self, cand: np.ndarray, par: np.ndarray, ev: np.ndarray) -> list[int]:
        """The indices of the nodes of `cand` that go (`ev`) while their parent stays."""
        pos = self._pos_scratch
        pos[cand[ev]] = 0
        top = np.flatnonzero(ev & (pos[par] < 0)).tolist()
        pos[cand[ev]] = -1
        return top

    def _first_trigger(self, cand: np.ndarray, par: np.ndarray, top: list[int], parked: bool) -> int:
        """The length of the run up to and including the first node whose drop makes its parent
        an evictable leaf that is not queued (one-at-a-time eviction takes that parent next);
        the whole run if none does. With `parked` nodes in the run, a parent popped earlier in
        the run (parked) is not queued; one later in it still is."""
        m = len(cand)
        ndev, state, ref = self._ndev_v, self._state_v, self._ref_v
        if len(top) == 1:  # the usual run: one chain; its top's parent keeps other device children
            p = int(par[top[0]])
            if ndev[p] > 1 or state[p] != GPU or ref[p]:
                return m
        counts: dict[int, int] = {}
        last: dict[int, int] = {}
        for t in top:
            p = int(par[t])
            counts[p] = counts.get(p, 0) + 1
            last[p] = t
        cut = m
        for p, c in counts.items():
            at = last[p]
            if (ndev[p] == c and state[p] == GPU and ref[p] == 0 and at + 1 < cut
                    and p not in self._dev_lru):
                if parked:
                    where = np.flatnonzero(cand == p)
                    if len(where) and where[0] > at:
                        continue  # still queued when its last child goes
                cut = at + 1
        return cut

    def _drop_run(self, drop: np.ndarray, par: np.ndarray, top: list[int], devs: list[int]) -> None:
        """Free the nodes `drop` (unreferenced GPU nodes whose children are all in `drop`, in
        eviction order; `par` their parents); `top` indexes those whose
        parent stays: only they are unlinked from a live node. Their parents that become
        evictable leaves are queued at the front. The node surgery is one C call (instead of a
        dozen numpy operations and three loops)."""
        keys = self._keys
        m = len(drop)
        if self._remembers:
            self._dev_lru.forget(drop, keys)
        if self._obs is not None:  # device-only nodes (the batched path runs without a host tier)
            self._obs.removed(ON_DEVICE, [keys[v] for v in drop.tolist()])
        freed_parents = _drop_run_c(self._f, np.ascontiguousarray(drop, dtype=np.int32),
                                    np.ascontiguousarray(par, dtype=np.int32), top, DROP_ROWS,
                                    RESET_ROW, keys, self._map, devs, self._stack, self._top, self.device_pool.ids)
        self._dropped(m, freed_parents)

    def _dropped(self, m: int, freed_parents: list[int]) -> None:
        """A run of `m` device nodes was freed (their ids pushed on the free-id stack): count
        them, and queue at the front their parents left without device children that can go."""
        self._top += m
        self._dev_cached -= m
        self._idle -= m
        state, ref = self._state_v, self._ref_v
        for p in freed_parents:
            if state[p] == GPU and ref[p] == 0 and p not in self._dev_lru:
                self._dev_lru.push_front(p)

    def _drop_leaf(self, v: int, devs: list[int]) -> None:
        """Drop an unreferenced GPU leaf (no children, no task): `_unlink` + `_free_node`
        written out, with only the fields that are not already at their reset values."""
        parent_v, next_v, prev_v, dev_v = self._parent_v, self._next_v, self._prev_v, self._dev_v
        p, before, after = parent_v[v], prev_v[v], next_v[v]
        if self._cont_v[p] == v:
            self._cont_v[p] = -1
        else:
            del self._map[self._keys[v]]
        if self._obs is not None:
            self._tell_lost(v)
        if self._remembers:
            self._dev_lru.forget(np.array([v], dtype=np.int32), self._keys)
        self._keys[v] = None
        if before >= 0:
            next_v[before] = after
        else:
            self._child_v[p] = after
        if after >= 0:
            prev_v[after] = before
        devs.append(dev_v[v])
        self._dev_cached -= 1
        self._idle -= 1
        parent_v[v] = dev_v[v] = next_v[v] = prev_v[v] = -1
        self._hits_v[v] = 0
        state = self._state_v
        state[v] = FREE
        self._stack_v[self._top] = v
        self._top += 1
        left = self._ndev_v[p] - 1  # _device_child_gone, inlined
        self._ndev_v[p] = left
        if (left == 0 and state[p] == GPU and self._ref_v[p] == 0 and p not in self._dev_lru
                and p not in self._handed_out):
            self._dev_lru.push_front(p)
        if after < 0 and before < 0 and state[p] == CPU:
            self._host_leaf_again(p)

    def _finish_eviction(self, dropped: list[int], freed_hosts: list[int], hosts: list[int],
                         victims: np.ndarray | list[int], victim_keys: list[bytes], evicted: int,
                         task_id: int, blocks: tuple[np.ndarray | list[int], np.ndarray | list[int]]) -> None:
        """The end of an eviction: recycle what it freed in one batch, issue its swap-out
        (`blocks`: the victims' device and host blocks; `hosts`: host blocks taken but unused)."""
        self.host_pool.free(hosts + freed_hosts)
        self.device_pool.free(dropped)
        if len(victims):
            self._new_task(TaskKind.SWAP2CPU, victims, blocks[0], blocks[1], victim_keys, task_id=task_id)
            self._dev_returning += len(victims)
            self.metrics.swap_out_blocks += len(victims)
        self.metrics.evicted_device_blocks += evicted
        log.debug("evicted %d device blocks (%d to host)", evicted, len(victims))

    def _take_host(self, n: int, hosts: np.ndarray, at: int) -> int:
        """Up to `n` host blocks, written to `hosts` from index `at`; returns how many: free
        ones first, then by dropping host leaves in the policy's order, a run (`pop_many`) at a
        time: a run of chains released deepest first is freed with a few array operations
        (Python touching each chain's top), exactly as popping and dropping one leaf at a time
        would; any other run goes node by node."""
        pool = self.host_pool
        k = min(n, pool.num_free)
        if k:
            hosts[at:at + k] = pool.allocate(k)
        policy = self._host_lru
        got = k
        while got < n:
            cand = policy.pop_many(n - got)
            if not len(cand):
                break
            got += self._drop_host_run(cand, hosts, at + got)
        self.metrics.evicted_host_blocks += got - k
        return got

    def _drop_host_run(self, cand: np.ndarray, hosts: np.ndarray, at: int) -> int:
        """Drop the host leaves of the popped run `cand` as one-at-a-time eviction would, their
        blocks written to `hosts` from index `at`; returns how many. A run whose every node is a leaf once the
        nodes before it are gone (a chain's only child comes right before it) is freed at once,
        in one C call (runtime/cache/_cache_core.c drop_host_run); it is cut after the first node
        whose drop makes its parent an unqueued host leaf (that parent comes next), the rest
        going back to the front of the queue."""
        policy = self._host_lru
        # a remembering policy's memory of the keys that leave, written by the C call itself
        # where the policy lets it (`remember_into`); else the keys of the nodes dropped, handed
        # over by the C call as it frees them (for the observer and a policy that remembers
        # only through `forget`), and their uses, taken before
        remember = self._dev_lru.remember_into() if self._remembers else None
        forget = self._remembers and remember is None
        gone = [] if forget or self._obs is not None else None
        hits = self._f[HITS, cand] if forget else None
        got = _drop_host_run_c(self._f, cand, HOST_DROP_ROWS, CPU, RESET_ROW, self._keys, self._map, hosts, at,
                               self._stack, self._top, policy, gone, remember)
        if got is None:
            return self._drop_host_slow(cand, hosts, at)
        cut, leaf = got
        if hits is not None:
            self._dev_lru.forget(cand[:cut], gone, hits[:cut])
        if cut < len(cand):
            policy.push_front_run(cand[cut:].tolist())
        if self._obs is not None:  # host-only nodes
            self._obs.removed(ON_HOST, gone)
        self._host_cached -= cut
        self._top += cut
        if leaf >= 0:
            policy.push_front(leaf)
        return cut

    def _drop_host_slow(self, cand: np.ndarray, hosts: np.ndarray, at: int) -> int:
        """`_drop_host_run` node by node, for a run of any shape, as popping one node at a time
        would: a node with children is parked; a dropped node's parent that becomes a host leaf
        keeps its turn if it is queued or comes later in the run, and otherwise is next in line:
        the run ends there (the rest goes back to the front of the queue, behind that parent).
        Each node is unlinked in turn (the next one's fate reads the links); the dropped ones
        are freed together at the end, in order, as `_free_node` frees them (host queue nodes
        are CPU nodes without a task or a device block, already out of both queues)."""
        f = self._f
        policy = self._host_lru
        # the walk and the unlinking, one C call (runtime/cache/_cache_core.c drop_host_nodes)
        freed = np.empty(len(cand), dtype=np.int32)
        k, last, leaf = _drop_host_nodes_c(f, cand, HOST_DROP_ROWS[:7], CPU, self._keys, self._map,
                                           self._pos_scratch, policy, freed)
        freed = freed[:k]
        if self._remembers:
            self._dev_lru.forget(freed, self._keys)
        if last >= 0:
            policy.push_front_run(cand[last + 1:].tolist())
            self._host_leaf_again(leaf)  # the parent is next, ahead of the rest
        if self._obs is not None:
            for v in freed.tolist():
                self._tell_lost(v)
        # the freeing, one C call too (free_host_nodes: host blocks, task, key, column, id)
        _free_host_nodes_c(f, freed, self._task, self._stack, hosts, self._top, at, HOST, RESET_ROW, self._keys)
        self._host_cached -= k
        self._top += k
        return k
