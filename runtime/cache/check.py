"""The prefix cache's invariant checker (`PrefixCache.check`; O(blocks), for tests and debug
runs). Kept apart from the cache because it reads every structure the others keep: per tier
every block is exactly one of free, cached (held by a node) or in use (a request's private
block, a task's), and free + cached + used = total; the tree, its key map, reference counts,
eviction queues and task bookkeeping agree; a free node id carries no stale field.
"""
from __future__ import annotations

from typing import Callable

from kvrt.ipc.protocol import TaskKind

from kvrt.runtime.cache.nodes import CPU, DETACHED, FREE, GPU, RESET, ROOT, STATE, SWAP2CPU, SWAP2GPU, NodeState, NodeStore


class Checker:
    """The invariant checker behind PrefixCache.check (`cache` is the PrefixCache: its node
    store with the requests, tasks and pools the other parts keep)."""

    def __init__(self, cache: NodeStore):
        self.c = cache

    def run(self) -> None:
        c = self.c
        state = c._f[STATE].tolist()
        live = [n for n in range(1, len(state)) if state[n] != FREE]
        self._ids(live)
        in_tree = [n for n in live if state[n] != DETACHED]
        self._fields(live, state)
        self._tree(in_tree, state)
        self._refs(live)
        self._lrus(in_tree, state)
        self._blocks(live)
        self._reads()

    def _reads(self) -> None:
        """A device block a task still reads (a swap-out, a write to storage) is not free: a
        step could be given it and write into it under the copy. A node matched back during a
        swap-out is a live node of that swap-out."""
        c = self.c
        free = set(c.device_pool.free_blocks())
        for t in c._tasks.values():
            if t.task.kind.reads == "device":
                both = free.intersection(t.task.device_blocks)
                _expect(not both, lambda: f"task {t.task.task_id} ({t.task.kind}) reads free device blocks {sorted(both)[:8]}")
        for n, task_id in c._wanted_back.items():
            t = c._tasks.get(task_id)
            _expect(t is not None and t.task.kind is TaskKind.SWAP2CPU and n in t.nodes
                    and c._state_v[n] in (GPU, DETACHED), lambda: f"node {n} wanted back from task {task_id}")

    def _ids(self, live: list[int]) -> None:
        c = self.c
        free_ids = c._stack[:c._top].tolist()
        every = free_ids + live + [ROOT]
        _expect(len(every) == len(set(every)) == c._f.shape[1],
                lambda: f"node ids: {len(free_ids)} free + {len(live)} live + root != {c._f.shape[1]} "
                f"or an id is both free and live")
        ids = c._stack[:c._top]
        free = set(free_ids)  # (a queue's stamped nodes are the ones `in` it)
        clean = ((c._f[:, ids] == RESET[:, None]).all() and (c._task[ids] == -1).all()
                 and set(map(c._keys.__getitem__, free_ids)) <= {None}
                 and free.isdisjoint(c._dev_lru.stamped()) and free.isdisjoint(c._host_lru.stamped()))
        _expect(bool(clean), "a free node id has stale fields")

    def _fields(self, live: list[int], state: list[int]) -> None:
        c = self.c
        for n in live:
            s, d, h, t, r = state[n], c._dev_v[n], c._host_v[n], c._task_v[n], c._ref_v[n]
            why = ""
            if s == GPU:
                ok = d >= 0 and h < 0 and t < 0
            elif s == SWAP2CPU:
                ok = d >= 0 and h >= 0 and r == 0 and self._kind(t) is TaskKind.SWAP2CPU
            elif s == CPU:
                ok = d < 0 and h >= 0 and t < 0 and r == 0
            elif s == SWAP2GPU:
                deferred = t in {x.task.task_id for x in c._deferred}
                ok = (d >= 0) != deferred and h >= 0 and self._kind(t) is TaskKind.SWAP2GPU
            else:
                ok, why = d >= 0 or h >= 0, ": detached without blocks"
                if ok:
                    ok, why = r > 0 or t >= 0, ": detached but nothing holds it"
            if not ok:
                raise AssertionError(f"node {n} ({NodeState(s).name}, dev={d}, host={h}, task={t}, ref={r}){why}")

    def _kind(self, task_id: int) -> TaskKind | None:
        t = self.c._tasks.get(task_id)
        return t.task.kind if t is not None else None

    def _tree(self, in_tree: list[int], state: list[int]) -> None:
        # (the loops below test inline and format a message only on failure: this runs after
        # every step of the property tests)
        c = self.c
        cont_v, parent_v, child_v, next_v, prev_v, ndev_v = c._cont_v, c._parent_v, c._child_v, c._next_v, c._prev_v, c._ndev_v
        nodes = [ROOT] + in_tree
        conts = {cont_v[n] for n in nodes} - {-1}
        _expect(len(c._map) + len(conts) == len(in_tree),
                lambda: f"{len(c._map)} keys mapped + {len(conts)} continuations != {len(in_tree)} nodes in the tree")
        keys, gone = c._keys, (FREE, DETACHED)
        for key, n in c._map.items():
            if not (keys[n] == key and state[n] not in gone and n not in conts):
                raise AssertionError(f"key of node {n} is stale")
        for n in nodes:
            k = cont_v[n]
            if not (k < 0 or (parent_v[k] == n and state[k] not in gone)):
                raise AssertionError(f"continuation {k} of node {n} is not its child")
        for n in nodes:
            k, before, on_dev = child_v[n], -1, 0
            while k >= 0:
                if not (parent_v[k] == n and prev_v[k] == before):
                    raise AssertionError(f"sibling links of node {k}")
                on_dev += state[k] == GPU or state[k] == SWAP2GPU
                before, k = k, next_v[k]
            if ndev_v[n] != on_dev:
                kids = []
                k = child_v[n]
                while k >= 0:
                    kids.append(k)
                    k = next_v[k]
                raise AssertionError(f"node {n}: ndev={ndev_v[n]} but children states {[state[k] for k in kids]}")
            if n != ROOT:
                p = parent_v[n]
                if not (p == ROOT or state[p] not in gone):
                    raise AssertionError(f"node {n} hangs off node {p}")

    def _refs(self, live: list[int]) -> None:
        c = self.c
        want = dict.fromkeys(live, 0)
        paths = [r.path for r in c._reqs.values()] + [t.path for t in c._tasks.values()]
        for path in paths:
            for n in path.tolist():
                want[n] += 1
        for r in c._reqs.values():  # side groups' nodes (runtime/cache/groups.py)
            for refs in r.side:
                for n in refs.held():
                    want[n] += 1
        ref_v = c._ref_v
        for n in live:
            if ref_v[n] != want[n]:
                raise AssertionError(f"node {n}: ref={ref_v[n]} but {want[n]} holders")
        _expect(c._ref_v[ROOT] == 1, "root lost its pin")

    def _lrus(self, in_tree: list[int], state: list[int]) -> None:
        c = self.c
        ref_v, ndev_v, child_v, dev_q, host_q = c._ref_v, c._ndev_v, c._child_v, c._dev_lru, c._host_lru
        dev_members, host_members = dev_q.members(), host_q.members()
        for q, members in ((dev_q, dev_members), (host_q, host_members)):
            _expect(len(members) == len(set(members)) and set(members) == set(q.stamped()),
                    "an LRU queue's stamps and entries disagree")
        for n in dev_members:
            if not (state[n] == GPU and ref_v[n] == 0):
                raise AssertionError(f"node {n} in the device LRU: {NodeState(state[n]).name}, ref {ref_v[n]}")
        for n in host_members:
            if state[n] != CPU:
                raise AssertionError(f"node {n} in the host LRU is {NodeState(state[n]).name}")
        wanted_back = c._wanted_back
        for n in in_tree:
            s = state[n]
            if s == GPU and ref_v[n] == 0 and ndev_v[n] == 0 and n not in wanted_back and n not in dev_q:
                raise AssertionError(f"evictable device leaf {n} is not in the device LRU")
            if s == CPU and child_v[n] < 0 and n not in host_q:
                raise AssertionError(f"evictable host leaf {n} is not in the host LRU")

    def _blocks(self, live: list[int]) -> None:
        c = self.c
        detached = [n for n in live if c._state_v[n] == DETACHED]
        in_tree = [n for n in live if c._state_v[n] != DETACHED]
        dev_nodes = [c._dev_v[n] for n in in_tree if c._dev_v[n] >= 0]
        host_nodes = [c._host_v[n] for n in in_tree if c._host_v[n] >= 0]
        dev_used = [c._dev_v[n] for n in detached if c._dev_v[n] >= 0]
        host_used = [c._host_v[n] for n in detached if c._host_v[n] >= 0]
        for req in c._reqs.values():
            skip = c._tasks[req.load].primary if req.load >= 0 else 0
            dev_used += req.blocks[len(req.path) + skip:] + req.dups
            loading = set(c._tasks[req.load].task.device_blocks) if req.load >= 0 else set()
            for refs in req.side:
                dev_used += [b for b in refs.private() if b not in loading]
                _expect(len(refs.nodes) == len(refs.blocks) == len(req.blocks)
                        and all(n < 0 and b < 0 for n, b in zip(refs.nodes[:refs.live], refs.blocks[:refs.live])),
                        "a side group's table is out of step with group 0's, or holds a released block")
                for n, b in zip(refs.nodes, refs.blocks):
                    if n >= 0 and b >= 0 and b not in refs.dups:
                        _expect(b == c._dev_v[n], lambda: f"side node {n}'s page {c._dev_v[n]} is not its request's {b}")
        for t in c._tasks.values():
            if t.task.kind is TaskKind.STORAGE2GPU:
                dev_used += t.task.device_blocks
            host_used += t.orphans
            dev_used += t.dev_orphans
        _expect(c._dev_cached == len(dev_nodes), lambda: f"device cached count {c._dev_cached} != {len(dev_nodes)}")
        idle = sum(1 for n in in_tree if c._state_v[n] == GPU and c._ref_v[n] == 0)
        _expect(c._idle == idle, lambda: f"idle device node count {c._idle} != {idle}")
        _expect(c._host_cached == len(host_nodes), lambda: f"host cached count {c._host_cached} != {len(host_nodes)}")
        returning = sum(1 for t in c._tasks.values() if t.task.kind is TaskKind.SWAP2CPU
                        for n in t.nodes if c._task_v[n] == t.task.task_id)
        _expect(c._dev_returning == returning, lambda: f"{c._dev_returning} device blocks said returning, {returning} are")
        _expect(c._deferred_need == sum(len(t.nodes) for t in c._deferred), "deferred swap-in count")
        for req in c._reqs.values():
            deferred = any(t.task.task_id in req.waiting for t in c._deferred)
            _expect(deferred or -1 not in req.blocks, "a ready block table has a hole")
        for pool, cached, used in ((c.device_pool, dev_nodes, dev_used), (c.host_pool, host_nodes, host_used)):
            free = pool.free_blocks()
            every = free + cached + used
            _expect(len(every) == pool.num_blocks and sorted(every) == list(range(pool.num_blocks)),
                    lambda: f"{pool.tier}: free {len(free)} + cached {len(cached)} + used {len(used)} != "
                    f"total {pool.num_blocks}, or a block is owned twice / lost: "
                    f"{_dupes(every)} twice, {sorted(set(range(pool.num_blocks)) - set(every))[:10]} lost")


def _dupes(items: list[int]) -> list[int]:
    seen: set[int] = set()
    return sorted({x for x in items if x in seen or seen.add(x)})[:10]


def _expect(cond: bool, msg: str | Callable[[], str]) -> None:
    """Fail with `msg`; a callable one is formatted only then (a check runs after every step of
    the property tests, and most messages cost more to format than their condition to test)."""
    if not cond:
        raise AssertionError(msg() if callable(msg) else msg)
