"""Transfer-task bookkeeping of the prefix cache: which tasks are in flight, what they move,
who waits for them, and what applying a result does.

Swaps and storage transfers are tasks the engine hands to the cache-transfer ranks (ipc/protocol.py
TransferTask, numbered here: the id the ranks answer to is the id this bookkeeping keys on).
Swaps are asynchronous, so with a full device the blocks a swap-in needs are often still being
copied out. Such a swap-in is deferred, not dropped: its task is created at once (later
requests for the same blocks join it) and is issued, with destinations, as soon as swap-outs
return enough blocks. Deferred swap-ins are served before new allocations.

A failed swap-out leaves the node on the device; a failed swap-in drops its nodes and
everything below them, and the requests waiting for them fail.
"""
from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

from kvrt.ipc.protocol import TaskKind, TransferTask

from kvrt.runtime.cache.keys import group_key
from kvrt.runtime.cache.match import Request
from kvrt.runtime.cache.nodes import (CPU, DETACHED, DEV, FREE, GPU, HOST, NO_NODES, ON_DEVICE, ON_HOST, REF, STATE,
                          SWAP2CPU, SWAP2GPU, NodeStore)

from kvrt.runtime.cache.core import finish_swap_out as _finish_swap_out_c

log = logging.getLogger(__name__)

SWAP_OUT_DONE_ROWS = (DEV, STATE)  # the rows finish_swap_out writes, in its order


@dataclass(slots=True)
class TaskOutcome:
    """What applying a task result means for requests. `ready`: request id -> prompt tokens whose
    KV is now in place, for requests whose last pending task this was (they may run; a failed or
    short storage read lowers the count and the rest is computed). `failed`: requests that lost
    KV they were waiting for (a failed swap-in); the engine aborts and releases them."""

    task: TransferTask
    ok: bool
    ready: dict[Hashable, int] = field(default_factory=dict)
    failed: list[Hashable] = field(default_factory=list)


class Task:
    """Bookkeeping of an in-flight task: the nodes it moves (a swap-out's as an int32 array, as
    eviction writes them), the requests waiting for it, and
    blocks it owns outright (hosts of swap-outs cancelled by a re-match; a storage read's
    destinations, once its request is gone; device blocks of nodes matched back during a
    swap-out and dropped before it answered, which it still reads)."""

    __slots__ = ("task", "nodes", "waiters", "request", "orphans", "dev_orphans", "path", "issued", "primary")

    def __init__(self, task: TransferTask, nodes: list[int] | np.ndarray):
        self.task = task
        self.nodes = nodes
        self.waiters: set[Hashable] = set()
        self.request: Hashable | None = None
        self.orphans: list[int] = []
        self.dev_orphans: list[int] = []
        self.path: np.ndarray = NO_NODES
        self.issued = False
        self.primary = 0  # a storage read: its leading device blocks that are group 0's (the rest: side groups')


class TaskBook(NodeStore):
    """Task bookkeeping, mixed into PrefixCache."""

    def __init__(self) -> None:
        self._tasks: dict[int, Task] = {}
        self._new_tasks: list[TransferTask] = []
        self._deferred: deque[Task] = deque()  # swap-ins waiting for device blocks, FIFO
        self._deferred_need = 0
        self._task_ids = itertools.count(1)
        self._dev_returning = 0  # device blocks that in-flight swap-outs free when done
        self._storing: set[bytes] = set()  # keys of in-flight write-through tasks
        # nodes matched again while a swap-out copied them (flipped back) -> that swap-out: until
        # it answers, eviction parks them (their device block is still being read)
        self._wanted_back: dict[int, int] = {}

    def _take_tasks(self) -> list[TransferTask]:
        out, self._new_tasks = self._new_tasks, []
        for task in out:
            self._tasks[task.task_id].issued = True
        return out

    def _apply(self, task_id: int, ok: bool, blocks: int | None) -> TaskOutcome:
        t = self._tasks.get(task_id)
        if t is None or not t.issued:
            raise ValueError(f"task {task_id} is not in flight")
        del self._tasks[task_id]
        out = TaskOutcome(t.task, ok)
        self._FINISH[t.task.kind](self, t, ok, blocks, out)
        if ok:
            self.metrics.tasks_done += 1
        else:
            self.metrics.tasks_failed += 1
            log.warning("%s task %d failed (%d blocks)", t.task.kind, task_id, len(t.task.device_blocks))
        self._pump_deferred()
        return out

    def _new_task(self, kind: TaskKind, nodes: list[int] | np.ndarray, device_blocks: list[int] | np.ndarray,
                  host_blocks: list[int] | np.ndarray, keys: list[bytes] | None = None, issue: bool = True,
                  task_id: int = -1) -> Task:
        if keys is None:
            keys = [self._keys[n] for n in nodes]
        if task_id < 0:
            task_id = next(self._task_ids)
        task = TransferTask(task_id, kind, device_blocks, host_blocks, keys)
        t = Task(task, nodes)
        self._tasks[task.task_id] = t
        if issue:
            self._new_tasks.append(task)
        return t

    def _finish_swap_out(self, t: Task, ok: bool, blocks: int | None, out: TaskOutcome) -> None:
        """Done: the node is CPU and its device block is free. Failed: the node is dropped
        (with its host-only descendants) and both its blocks are free: the swap-out was asked
        for to free device blocks, and a host tier that fails or times out must not have the
        same blocks offered to it again and again while requests wait for them. Nodes matched
        again meanwhile were already GPU; their host blocks are the task's orphans."""
        task_id = t.task.task_id
        nodes = np.asarray(t.nodes, dtype=np.int32)  # (eviction makes them an int32 array already)
        f = self._f
        # the usual answer: every node still in the tree and still this task's; all at once, in
        # one C call (runtime/cache/_cache_core.c finish_swap_out; None: some node is not)
        devs = (_finish_swap_out_c(f, nodes, self._task, task_id, SWAP_OUT_DONE_ROWS, SWAP2CPU, CPU)
                if ok else None)
        if devs is not None:
            self._dev_returning -= len(devs)
            self._dev_cached -= len(devs)
            if self._obs is not None:
                for n in nodes.tolist():
                    self._tell_moved(n, ON_DEVICE, ON_HOST)
            self._host_lru.push(nodes)
            self.device_pool.free(devs + t.dev_orphans)
            self.host_pool.free(t.orphans)
            return
        devs = t.dev_orphans
        hosts = t.orphans
        on_host: list[int] = []
        for n in nodes.tolist():
            if self._task_v[n] != task_id:  # flipped back: its device block may go now
                if self._wanted_back.get(n) == task_id:
                    del self._wanted_back[n]
                    if (self._state_v[n] == GPU and self._ref_v[n] == 0 and not self._ndev_v[n]
                            and n not in self._dev_lru):
                        self._dev_lru.push_front(n)  # parked by eviction meanwhile
                continue
            self._task_v[n] = -1
            self._dev_returning -= 1
            if self._state_v[n] == DETACHED:
                if self._ref_v[n] == 0:
                    self._free_node(n, devs, hosts)
            elif ok:
                devs.append(self._dev_v[n])
                self._dev_v[n] = -1
                self._dev_cached -= 1
                self._state_v[n] = CPU
                on_host.append(n)
                if self._obs is not None:
                    self._tell_moved(n, ON_DEVICE, ON_HOST)
            else:
                self._drop_subtree(n, devs, hosts)
        self._host_lru.push(np.array(on_host, dtype=np.int32))
        self.device_pool.free(devs)
        self.host_pool.free(hosts)

    def _finish_swap_in(self, t: Task, ok: bool, blocks: int | None, out: TaskOutcome) -> None:
        """Done: the nodes are GPU and their host blocks free. Failed: the nodes and everything
        below them leave the tree, and the requests waiting for them fail."""
        devs: list[int] = []
        hosts: list[int] = []
        nodes = np.array(t.nodes, dtype=np.int32)
        self._task[nodes] = -1
        f = self._f
        if ok and (f[STATE, nodes] == SWAP2GPU).all():  # the usual answer: all at once
            hosts = f[HOST, nodes].tolist()
            f[HOST, nodes] = -1
            self._host_cached -= len(hosts)
            f[STATE, nodes] = GPU
            if self._obs is not None:
                for n in t.nodes:
                    self._tell_moved(n, ON_HOST, ON_DEVICE)
            for n in nodes[f[REF, nodes] == 0].tolist():  # its requests left before it arrived
                self._dev_lru.push_front(n)
                self._idle += 1
            nodes = NO_NODES
        for n in nodes.tolist():
            s = self._state_v[n]
            if s == FREE:
                continue  # freed just above, with the subtree of a failed ancestor
            if s == DETACHED:  # its host copy is of no more use either way
                hosts.append(self._host_v[n])
                self._host_v[n] = -1
                if self._ref_v[n] == 0:
                    self._free_node(n, devs, hosts)
            elif not ok:
                self._drop_subtree(n, devs, hosts)
            else:
                hosts.append(self._host_v[n])
                self._host_v[n] = -1
                self._host_cached -= 1
                self._state_v[n] = GPU
                if self._obs is not None:
                    self._tell_moved(n, ON_HOST, ON_DEVICE)
                if self._ref_v[n] == 0:  # its requests left before it arrived
                    self._dev_lru.push_front(n)
                    self._idle += 1
        self.device_pool.free(devs)
        self.host_pool.free(hosts)
        task_id = t.task.task_id
        for rid in t.waiters:
            req = self._reqs[rid]
            req.waiting.discard(task_id)
            if not ok:
                req.frozen = True
                out.failed.append(rid)
                if req.counted:
                    self.metrics.hit_tokens_host -= req.host_hits * self.block_size
                    req.counted = False
            elif not req.waiting:
                out.ready[rid] = req.cached_tokens

    def _finish_storage_read(self, t: Task, ok: bool, blocks: int | None, out: TaskOutcome) -> None:
        """The first `blocks` blocks (default: all if ok, none if not) hold their KV: they enter
        the tree like computed blocks. The rest stay private to the request, which computes them."""
        n = len(t.task.device_blocks)
        loaded = (n if ok else 0) if blocks is None else max(0, min(blocks, n))
        if n > t.primary:  # side groups' pages too: all or nothing (a hit needs its window)
            loaded = t.primary if loaded == n else 0
        rid = t.request
        if rid is None:  # the request left meanwhile: the blocks were the task's to free
            self.device_pool.free(t.task.device_blocks)
            return
        req = self._reqs[rid]
        req.load = -1
        req.waiting.discard(t.task.task_id)
        self.metrics.storage_read_blocks += loaded
        if req.counted:  # the hit counters count what was read, not what was hoped for
            self.metrics.hit_tokens_storage -= (t.primary - loaded) * self.block_size
            if not loaded and not req.cached_tokens:  # (a shared store's lookup misses often)
                self.metrics.hit_requests -= 1
        if loaded:
            req.cached_tokens += loaded * self.block_size
            if not req.frozen:
                before = len(req.path)
                self._record(req, before + loaded)
                req.num_matched = len(req.path)  # read, not computed: not written back
                if req.side and not req.frozen:
                    self._record_sides(req, before)
            if req.side:
                self._slide(req, req.cached_tokens)
        elif req.side:  # nothing read: the tables are what they were before the read
            self.device_pool.free(t.task.device_blocks)
            self._side_unread(req, len(req.path))
            req.blocks = req.blocks[:len(req.path)]
        if not req.waiting:
            out.ready[rid] = req.cached_tokens

    def _finish_storage_write(self, t: Task, ok: bool, blocks: int | None, out: TaskOutcome) -> None:
        """The request's references (held for the copy) go; its keys may be stored again."""
        self._deref(t.path)
        self._storing.difference_update(t.task.keys)
        if ok:
            self.metrics.storage_write_blocks += len(t.task.keys)

    # what applying each kind's result does (the kind table is ipc/protocol.py's TaskKind)
    _FINISH = {TaskKind.SWAP2CPU: _finish_swap_out, TaskKind.SWAP2GPU: _finish_swap_in,
               TaskKind.STORAGE2GPU: _finish_storage_read, TaskKind.GPU2STORAGE: _finish_storage_write}

    # ---- deferred swap-ins
    def _cancel_deferred(self, t: Task) -> None:
        """A deferred swap-in nobody waits for or holds any more: its nodes stay on the host
        (CPU) and its device blocks, never taken, are not needed."""
        self._deferred.remove(t)
        self._deferred_need -= len(t.nodes)
        del self._tasks[t.task.task_id]
        for n in t.nodes:
            self._task_v[n] = -1
            if self._state_v[n] == DETACHED:
                if self._ref_v[n] == 0:
                    devs: list[int] = []
                    hosts: list[int] = []
                    self._free_node(n, devs, hosts)
                    self.host_pool.free(hosts)
                continue
            self._state_v[n] = CPU
            self._device_child_gone(self._parent_v[n])
            if self._child_v[n] < 0 and self._ref_v[n] == 0:
                self._host_lru.push_front(n)

    def _pump_deferred(self) -> None:
        """Issue deferred swap-ins that fit, and start the evictions that make room for the
        oldest ones that free, returning and evictable blocks can hold together (a deferred
        swap-in whose request just waits must not depend on some other allocation to make its
        room). The backlog is served in turn: the oldest swap-in that fits alone gets its room
        even when the whole backlog would not fit, which is what keeps many swap-ins that
        wait together from waiting for ever."""
        self._start_deferred()
        if not self._deferred:
            return
        room = self.device_pool.num_free + self._dev_returning + self._idle
        need = 0
        for t in self._deferred:
            if need + len(t.nodes) > room:
                break
            need += len(t.nodes)
        short = need - self.device_pool.num_free - self._dev_returning
        if short > 0:
            self._evict_device(short)
            self._start_deferred()

    def _start_deferred(self) -> None:
        """Issue deferred swap-ins, oldest first, while free device blocks cover them."""
        pool = self.device_pool
        while self._deferred and pool.num_free >= len(self._deferred[0].nodes):
            t = self._deferred.popleft()
            dest = pool.allocate(len(t.nodes))
            self._deferred_need -= len(dest)
            for n, d in zip(t.nodes, dest):
                self._dev_v[n] = d
                self._dev_cached += self._state_v[n] != DETACHED
            t.task.device_blocks = dest
            self._new_tasks.append(t.task)
            for rid in t.waiters:
                req = self._reqs[rid]
                blocks = req.blocks
                for i, n in enumerate(req.path.tolist()):
                    if blocks[i] < 0:
                        blocks[i] = self._dev_v[n]
                if req.side:
                    self._side_fill_deferred(req)

    # ---- storage reads and writes
    def _read_storage(self, request_id: Hashable, req: Request, rest: Sequence[bytes]) -> int:
        """Look the keys after the tree's match up in storage; read the hits into new device
        blocks (a STORAGE2GPU task the request waits for). Returns the blocks to be read."""
        try:
            hits = max(0, min(int(self.storage_lookup(rest)), len(rest)))
        except Exception as e:  # the storage tier is an optimisation: a failing lookup is a miss
            log.warning("storage lookup failed, treated as a miss: %s", e)
            hits = 0
        if not hits:
            return 0
        keys = list(rest[:hits])
        spans = self._side_spans(req, hits) if req.side else []
        if spans:  # every side group's pages of the window before the end, from storage too
            side = [group_key(req.keys[i], g + 1) for g, (first, end) in enumerate(spans) for i in range(first, end)]
            try:
                if int(self.storage_lookup(side)) < len(side):
                    return 0
            except Exception as e:
                log.warning("storage lookup failed, treated as a miss: %s", e)
                return 0
            keys += side
        dest = self._take_device(len(keys))
        if dest is None:
            return 0
        t = self._new_task(TaskKind.STORAGE2GPU, [], dest, [], keys)
        t.request = request_id
        t.primary = hits
        req.blocks += dest[:hits]
        if spans:
            self._side_read(req, hits, dest[hits:], spans)
        req.load = t.task.task_id
        req.waiting.add(req.load)
        return hits

    def _write_back(self, req: Request, side: np.ndarray = NO_NODES) -> None:
        """Write-through: store the blocks this request computed (with the pages of its other
        layer groups it still holds, `side`); the task keeps the request's references (the
        whole path, so LRU order stays ancestors-after-descendants) until done. Blocks already
        stored, or being stored for another request that computed them too, are not written
        again."""
        stored, storing, keys = self.storage_known, self._storing, self._keys
        if req.side and not req.frozen:
            side = np.concatenate((self._side_tail(req), side))
        held = np.concatenate((side, req.path)) if len(side) else req.path
        own = [n for n in held.tolist() if self._state_v[n] == GPU
               and keys[n] not in storing and not stored([keys[n]])] if len(side) else \
            [n for n in req.path[req.num_matched:].tolist() if self._state_v[n] == GPU
             and keys[n] not in storing and not stored([keys[n]])]
        if not own:
            self._deref(held)
            return
        t = self._new_task(TaskKind.GPU2STORAGE, [], [self._dev_v[n] for n in own], [],
                           [keys[n] for n in own])
        storing.update(t.task.keys)
        t.path = held
