"""Device block allocation and eviction for the prefix cache.

Device eviction frees only what is missing (`need - free`, counting device blocks that
in-flight swap-outs will return), takes victims in the order of the eviction policy (LRU over
leaves by default, runtime/lru.py, behind runtime/cache_policy.py), swaps them to host blocks
when there are any (evicting host leaves to make room), else drops them, and recycles freed
blocks in one batch. Nothing is evicted for an allocation that would fail anyway. The loops
here run once per evicted block: they read the node matrix through its memoryviews directly,
with no call per block beyond the policy's `pop` (and `_drop_leaf`, written out for the one
path every block takes without a host tier).
"""
from __future__ import annotations

import logging

from ipc.protocol import TaskKind

from .cache_nodes import CPU, FREE, GPU, SWAP2CPU, NodeStore

log = logging.getLogger(__name__)


class Eviction(NodeStore):
    """Allocation with eviction, mixed into PrefixCache (it uses the pools, the metrics and the
    task bookkeeping of runtime/cache_tasks.py through the same object)."""

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
        short = self._low_water - self.device_pool.num_free - self._dev_returning - self._deferred_need
        if short > 0 and self.host_pool.num_blocks and self._idle:
            self._evict_device(min(short, self._idle))

    def _evict_device(self, n: int) -> None:
        """Evict up to `n` device blocks, least recently used leaves first: to host blocks (a
        SWAP2CPU task) while any can be had, else dropped."""
        pop = self._dev_lru.pop
        swap = self.host_pool.num_blocks > 0
        # free host blocks in one batch; host leaves are evicted one at a time, only as needed
        hosts = self.host_pool.allocate(min(n, self.host_pool.num_free)) if swap else []
        hosts.reverse()  # pop() then hands them out in the order they came
        victims: list[int] = []
        victim_keys: list[bytes] = []  # taken now: a victim may be detached before the end
        dropped: list[int] = []
        freed_hosts: list[int] = []
        evicted = 0
        task_id = -1  # of the swap-out, numbered at its first victim
        ndev, child = self._ndev_v, self._child_v
        while evicted < n:
            v = pop()
            if v < 0:
                break
            if ndev[v]:
                continue  # parked: requeued when its last device child leaves
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
        self._finish_eviction(dropped, freed_hosts, hosts, victims, victim_keys, evicted, task_id)

    def _drop_leaf(self, v: int, devs: list[int]) -> None:
        """Drop an unreferenced GPU leaf (no children, no task): `_unlink` + `_free_node`
        written out for the one path every evicted block takes without a host tier, with only the
        fields that are not already at their reset values."""
        parent_v, next_v, prev_v, dev_v = self._parent_v, self._next_v, self._prev_v, self._dev_v
        p, before, after = parent_v[v], prev_v[v], next_v[v]
        if self._cont_v[p] == v:
            self._cont_v[p] = -1
        else:
            del self._map[self._keys[v]]
        if self._obs is not None:
            self._tell_lost(v)
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
        state = self._state_v
        state[v] = FREE
        self._stack_v[self._top] = v
        self._top += 1
        left = self._ndev_v[p] - 1  # _device_child_gone, inlined
        self._ndev_v[p] = left
        if left == 0 and state[p] == GPU and self._ref_v[p] == 0 and p not in self._dev_lru:
            self._dev_lru.push_front(p)
        if after < 0 and before < 0 and state[p] == CPU:
            self._host_leaf_again(p)

    def _finish_eviction(self, dropped: list[int], freed_hosts: list[int], hosts: list[int],
                         victims: list[int], victim_keys: list[bytes], evicted: int,
                         task_id: int) -> None:
        """The end of an eviction: recycle what it freed in one batch, issue its swap-out."""
        self.host_pool.free(hosts + freed_hosts)
        self.device_pool.free(dropped)
        if victims:
            self._new_task(TaskKind.SWAP2CPU, victims, [self._dev_v[v] for v in victims],
                           [self._host_v[v] for v in victims], victim_keys, task_id=task_id)
            self._dev_returning += len(victims)
            self.metrics.swap_out_blocks += len(victims)
        self.metrics.evicted_device_blocks += evicted
        log.debug("evicted %d device blocks (%d to host)", evicted, len(victims))

    def _take_host(self, n: int) -> list[int]:
        """Up to `n` host blocks: free ones first, then by dropping least recently used host
        leaves."""
        pool = self.host_pool
        got = pool.allocate(min(n, pool.num_free))
        pop = self._host_lru.pop
        dev_out: list[int] = []
        dropped = 0
        while len(got) < n:
            v = pop()
            if v < 0:
                break
            if self._child_v[v] >= 0:
                continue  # parked: requeued when its last child leaves
            self._unlink(v)
            self._free_node(v, dev_out, got)
            dropped += 1
        self.metrics.evicted_host_blocks += dropped
        return got

