"""The prefix cache's invariant checker (`PrefixCache.check`; O(blocks), for tests and debug
runs). Kept apart from the cache because it reads every structure the others keep: per tier
every block is exactly one of free, cached (held by a node) or in use (a request's private
block, a task's), and free + cached + used = total; the tree, its key map, reference counts,
eviction queues and task bookkeeping agree; a free node id carries no stale field.
"""
from __future__ import annotations

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
                _expect(not both, f"task {t.task.task_id} ({t.task.kind}) reads free device blocks {sorted(both)[:8]}")
        for n, task_id in c._wanted_back.items():
            t = c._tasks.get(task_id)
            _expect(t is not None and t.task.kind is TaskKind.SWAP2CPU and n in t.nodes
                    and c._state_v[n] in (GPU, DETACHED), f"node {n} wanted back from task {task_id}")

    def _ids(self, live: list[int]) -> None:
        c = self.c
        free_ids = c._stack[:c._top].tolist()
        every = free_ids + live + [ROOT]
        _expect(len(every) == len(set(every)) == c._f.shape[1],
                f"node ids: {len(free_ids)} free + {len(live)} live + root != {c._f.shape[1]} "
                f"or an id is both free and live")
        ids = c._stack[:c._top]
        clean = ((c._f[:, ids] == RESET[:, None]).all() and (c._task[ids] == -1).all()
                 and all(c._keys[n] is None for n in free_ids)
                 and not any(n in c._dev_lru or n in c._host_lru for n in free_ids))
        _expect(bool(clean), "a free node id has stale fields")

    def _fields(self, live: list[int], state: list[int]) -> None:
        c = self.c
        for n in live:
            s, d, h, t, r = state[n], c._dev_v[n], c._host_v[n], c._task_v[n], c._ref_v[n]
            desc = f"node {n} ({NodeState(s).name}, dev={d}, host={h}, task={t}, ref={r})"
            if s == GPU:
                _expect(d >= 0 and h < 0 and t < 0, desc)
            elif s == SWAP2CPU:
                _expect(d >= 0 and h >= 0 and r == 0 and self._kind(t) is TaskKind.SWAP2CPU, desc)
            elif s == CPU:
                _expect(d < 0 and h >= 0 and t < 0 and r == 0, desc)
            elif s == SWAP2GPU:
                deferred = t in {x.task.task_id for x in c._deferred}
                _expect((d >= 0) != deferred and h >= 0 and self._kind(t) is TaskKind.SWAP2GPU, desc)
            else:
                _expect(d >= 0 or h >= 0, desc + ": detached without blocks")
                _expect(r > 0 or t >= 0, desc + ": detached but nothing holds it")

    def _kind(self, task_id: int) -> TaskKind | None:
        t = self.c._tasks.get(task_id)
        return t.task.kind if t is not None else None

    def _tree(self, in_tree: list[int], state: list[int]) -> None:
        c = self.c
        conts = {c._cont_v[n] for n in [ROOT] + in_tree} - {-1}
        _expect(len(c._map) + len(conts) == len(in_tree),
                f"{len(c._map)} keys mapped + {len(conts)} continuations != {len(in_tree)} nodes in the tree")
        for key, n in c._map.items():
            _expect(c._keys[n] == key and state[n] not in (FREE, DETACHED) and n not in conts,
                    f"key of node {n} is stale")
        for n in [ROOT] + in_tree:
            k = c._cont_v[n]
            _expect(k < 0 or (c._parent_v[k] == n and state[k] not in (FREE, DETACHED)),
                    f"continuation {k} of node {n} is not its child")
        for n in [ROOT] + in_tree:
            kids = []
            k, before = c._child_v[n], -1
            while k >= 0:
                _expect(c._parent_v[k] == n and c._prev_v[k] == before, f"sibling links of node {k}")
                kids.append(k)
                before, k = k, c._next_v[k]
            _expect(c._ndev_v[n] == sum(state[k] in (GPU, SWAP2GPU) for k in kids),
                    f"node {n}: ndev={c._ndev_v[n]} but children states {[state[k] for k in kids]}")
            if n != ROOT:
                p = c._parent_v[n]
                _expect(p == ROOT or state[p] not in (FREE, DETACHED), f"node {n} hangs off node {p}")

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
        for n in live:
            _expect(c._ref_v[n] == want[n], f"node {n}: ref={c._ref_v[n]} but {want[n]} holders")
        _expect(c._ref_v[ROOT] == 1, "root lost its pin")

    def _lrus(self, in_tree: list[int], state: list[int]) -> None:
        c = self.c
        for q in (c._dev_lru, c._host_lru):
            members = q.members()
            _expect(len(members) == len(set(members)) and set(members) == set(q.stamped()),
                    "an LRU queue's stamps and entries disagree")
        for n in c._dev_lru.members():
            _expect(state[n] == GPU and c._ref_v[n] == 0, f"node {n} in the device LRU: {NodeState(state[n]).name}, ref {c._ref_v[n]}")
        for n in c._host_lru.members():
            _expect(state[n] == CPU, f"node {n} in the host LRU is {NodeState(state[n]).name}")
        for n in in_tree:
            if state[n] == GPU and c._ref_v[n] == 0 and c._ndev_v[n] == 0 and n not in c._wanted_back:
                _expect(n in c._dev_lru, f"evictable device leaf {n} is not in the device LRU")
            if state[n] == CPU and c._child_v[n] < 0:
                _expect(n in c._host_lru, f"evictable host leaf {n} is not in the host LRU")

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
                        _expect(b == c._dev_v[n], f"side node {n}'s page {c._dev_v[n]} is not its request's {b}")
        for t in c._tasks.values():
            if t.task.kind is TaskKind.STORAGE2GPU:
                dev_used += t.task.device_blocks
            host_used += t.orphans
            dev_used += t.dev_orphans
        _expect(c._dev_cached == len(dev_nodes), f"device cached count {c._dev_cached} != {len(dev_nodes)}")
        idle = sum(1 for n in in_tree if c._state_v[n] == GPU and c._ref_v[n] == 0)
        _expect(c._idle == idle, f"idle device node count {c._idle} != {idle}")
        _expect(c._host_cached == len(host_nodes), f"host cached count {c._host_cached} != {len(host_nodes)}")
        returning = sum(1 for t in c._tasks.values() if t.task.kind is TaskKind.SWAP2CPU
                        for n in t.nodes if c._task_v[n] == t.task.task_id)
        _expect(c._dev_returning == returning, f"{c._dev_returning} device blocks said returning, {returning} are")
        _expect(c._deferred_need == sum(len(t.nodes) for t in c._deferred), "deferred swap-in count")
        for req in c._reqs.values():
            deferred = any(t.task.task_id in req.waiting for t in c._deferred)
            _expect(deferred or -1 not in req.blocks, "a ready block table has a hole")
        for pool, cached, used in ((c.device_pool, dev_nodes, dev_used), (c.host_pool, host_nodes, host_used)):
            free = pool.free_blocks()
            every = free + cached + used
            _expect(len(every) == pool.num_blocks and sorted(every) == list(range(pool.num_blocks)),
                    f"{pool.tier}: free {len(free)} + cached {len(cached)} + used {len(used)} != "
                    f"total {pool.num_blocks}, or a block is owned twice / lost: "
                    f"{_dupes(every)} twice, {sorted(set(range(pool.num_blocks)) - set(every))[:10]} lost")


def _dupes(items: list[int]) -> list[int]:
    seen: set[int] = set()
    return sorted({x for x in items if x in seen or seen.add(x)})[:10]


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)
