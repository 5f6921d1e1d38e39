"""The prefix cache: a tree of KV blocks over the device and host tiers, driven by the engine.

What it does (PREFIX_CACHE.md, "Behaviour to keep"): full blocks of a request become tree nodes
keyed by their chained block key; a new request matches the longest cached prefix (device hits,
host hits that need a swap-in, then a storage lookup), allocates the rest with eviction, records
blocks as their KV is written, and releases everything when it finishes. Swaps and storage
transfers are tasks the engine hands to the cache-transfer ranks; their results come back through
`apply_task_result`. All of it is in-process and single-threaded: ordering by messages replaces
the reference system's lock (ARCHITECTURE.md §3).

Why this shape:
- Nodes are columns of one int32 matrix (a row per field) indexed by node id, not one Python
  object per node. At a million cached blocks the reference implementation spent ~35% of its time
  in garbage collection over per-node objects, dicts and lists; an int matrix holds no references
  for the collector to walk, a request's path is touched or released with a few vectorised numpy
  operations, a new chain of blocks is written with one, and single fields are read and written
  through memoryviews of the rows (as fast as list items). Node ids are recycled from a stack;
  freeing a node resets every field, so a reused id carries nothing stale (the checker verifies).
- Children are found by key without a children map per node. A key already chains its parent's
  key, so one dict (key -> node id) for the whole tree would do; but at a million keys every
  dict insert costs ~500 ns of cache misses (measured), more than all other per-block work. So
  each node has at most one "continuation" child (CONT: the next block of the chain it was
  recorded with) that is found by comparing its key, and only the other children (branch
  points, and chains started under a node that already has a continuation) are in the dict.
  Matching follows continuations and asks the dict only where they do not match; recording a
  chain costs at most one dict insert. Children are also intrusive sibling links (first child,
  next, prev), to unlink a node in O(1) and to walk a subtree that must be dropped.
- Eviction is LRU over leaves in O(1) per block amortised, with no heap to rebuild (unlike the
  reference's `list.remove` + `heapify` per node): see runtime/lru.py. The device queue holds
  every unreferenced GPU node in release order. References are taken along whole paths and
  released tail first, so an ancestor is always more recent than its descendants and the oldest
  entry is a leaf. A non-leaf found at the head anyway (a swap that finished out of order) is
  parked: taken off the queue and put back at its head when its last child leaves.
- A block enters the tree only when the caller reports its KV written (`update`), or when a
  storage read into it is reported done. Nothing unwritten is ever matchable (seed PR 7364).
- Device eviction frees only what is missing (`need - free`, counting device blocks that
  in-flight swap-outs will return), swaps victims to host blocks when there are any (evicting
  host leaves to make room), else drops them, and recycles freed blocks in one batch.
- The tiers are exclusive: a node's KV is on the device or on the host (on both only while a
  swap is in flight). A failed swap-out leaves the node on the device; a failed swap-in drops
  its nodes and everything below them, and the requests waiting for them fail.
- Swaps are asynchronous, so with a full device the blocks a swap-in needs are often still
  being copied out. Such a swap-in is deferred, not dropped: its task is created at once (later
  requests for the same blocks join it) and is issued, with destinations, as soon as swap-outs
  return enough blocks. Deferred swap-ins are served before new allocations.
"""
from __future__ import annotations

import enum
import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import numpy as np

from .block_pool import BlockPool
from .cache_metrics import CacheMetrics
from .lru import EvictionQueue

log = logging.getLogger(__name__)


class NodeState(enum.IntEnum):
    GPU = 0        # on the device, readable
    SWAP2CPU = 1   # being copied to a host block; the device copy stays readable until done
    CPU = 2        # on the host only
    SWAP2GPU = 3   # being copied into a device block; unusable until the swap reports done
    DETACHED = 4   # out of the tree (failed swap-in, reset): kept until its refs and task drain
    FREE = 5       # node id not in use


class CacheStatus(enum.IntEnum):
    """The prefix-tree status word, with the reference system's values."""

    NORMAL = 0
    UPDATING = 1
    CLEARING = -1
    CLEARED = -2


class TaskKind(str, enum.Enum):
    """Transfer task kinds; the values are the wire names of ipc/protocol.py."""

    SWAP2CPU = "swap2cpu"
    SWAP2GPU = "swap2gpu"
    STORAGE2GPU = "storage2gpu"
    GPU2STORAGE = "gpu2storage"


GPU, SWAP2CPU, CPU, SWAP2GPU, DETACHED, FREE = (int(s) for s in NodeState)
NORMAL = CacheStatus.NORMAL
ROOT = 0  # node 0 is the root: no key, no block, pinned by a permanent reference

# rows of the node matrix; the first seven are the ones a new chain writes, in one assignment
PARENT, CHILD, DEV, REF, NDEV, STATE, CONT, NEXT, PREV, HOST = range(10)
NEW_ROWS = 7
# a free node's column: no links, no blocks, no references, no device children, FREE
_RESET = np.array([-1, -1, -1, 0, 0, FREE, -1, -1, -1, -1], dtype=np.int32)
# block roles (PrefixCache.block_roles): free, in the tree (readable, immutable), private to a
# request (its worker computes into it), being written by a task, being read by a task
ROLE_FREE, ROLE_TREE, ROLE_PRIVATE, ROLE_LOADING, ROLE_SAVING = range(5)
# which tier each task kind reads and which it writes ("" = the storage tier)
_TASK_SIDES = {TaskKind.SWAP2CPU: ("device", "host"), TaskKind.SWAP2GPU: ("host", "device"),
               TaskKind.STORAGE2GPU: ("", "device"), TaskKind.GPU2STORAGE: ("device", "")}
_NO_NODES = np.empty(0, dtype=np.int32)
_NO_NODES.flags.writeable = False

StorageLookup = Callable[[Sequence[bytes]], int]


@dataclass(slots=True)
class CacheTask:
    """A transfer for the cache-transfer ranks. Swaps pair device_blocks[i] with host_blocks[i];
    storage tasks pair device_blocks[i] with keys[i]. Swap tasks carry their keys too."""

    task_id: int
    kind: TaskKind
    device_blocks: list[int]
    host_blocks: list[int]
    keys: list[bytes]


@dataclass(slots=True)
class MatchResult:
    """What a request found. `block_ids` is its block table for the matched prefix (device hits,
    swap-in and storage-read destinations, in token order; -1 for the destination of a deferred
    swap-in, see `PrefixCache.block_table`); it may run only once every task in `pending_tasks`
    has been applied as done."""

    block_ids: list[int]
    device_tokens: int = 0
    host_tokens: int = 0
    storage_tokens: int = 0
    pending_tasks: list[int] = field(default_factory=list)

    @property
    def cached_tokens(self) -> int:
        return self.device_tokens + self.host_tokens + self.storage_tokens

    @property
    def ready(self) -> bool:
        return not self.pending_tasks


@dataclass(slots=True)
class TaskOutcome:
    """What applying a task result means for requests. `ready`: request id -> prompt tokens whose
    KV is now in place, for requests whose last pending task this was (they may run; a failed or
    short storage read lowers the count and the rest is computed). `failed`: requests that lost
    KV they were waiting for (a failed swap-in); the engine aborts and releases them."""

    task: CacheTask
    ok: bool
    ready: dict[Hashable, int] = field(default_factory=dict)
    failed: list[Hashable] = field(default_factory=list)


class _Request:
    """The cache's view of one request. `path` (an int32 array, replaced, never modified) holds
    a reference on each node; `blocks` is the block table; `dups` are private blocks at path
    positions whose node holds another copy."""

    __slots__ = ("keys", "num_tokens", "path", "blocks", "dups", "num_matched", "cached_tokens",
                 "waiting", "load", "frozen", "admitted", "counted", "host_hits", "storage_hits")

    def __init__(self, keys: Sequence[bytes], num_tokens: int, frozen: bool, counted: bool):
        self.keys = keys
        self.num_tokens = num_tokens
        self.path: np.ndarray = _NO_NODES
        self.blocks: list[int] = []
        self.dups: list[int] = []
        self.num_matched = 0
        self.cached_tokens = 0
        self.waiting: set[int] = set()  # ids of tasks it must wait for
        self.load = -1                  # id of its in-flight storage read, if any
        self.frozen = frozen            # records nothing more (reset, detached path)
        self.admitted = False           # has allocated beyond its match: it is computing
        self.counted = counted          # its match is in the hit counters
        self.host_hits = 0              # blocks matched on the host tier / in storage
        self.storage_hits = 0


class _Task:
    """Bookkeeping of an in-flight task: the nodes it moves, the requests waiting for it, and
    blocks it owns outright (hosts of swap-outs cancelled by a re-match; a storage read's
    destinations, once its request is gone)."""

    __slots__ = ("task", "nodes", "waiters", "request", "orphans", "path", "issued")

    def __init__(self, task: CacheTask, nodes: list[int]):
        self.task = task
        self.nodes = nodes
        self.waiters: set[Hashable] = set()
        self.request: Hashable | None = None
        self.orphans: list[int] = []
        self.path: np.ndarray = _NO_NODES
        self.issued = False


class PrefixCache:
    """The engine's prefix cache over `num_device_blocks` device and `num_host_blocks` host
    blocks of `block_size` tokens.

    `storage_lookup(keys)`, if given, returns how many leading keys the storage tier holds;
    matching asks it for the blocks the tree lacks and reads hits with a STORAGE2GPU task.
    `write_through` writes the blocks a request computed to storage when it is released.
    `low_water` (with a host tier): device blocks kept free or on their way back by swapping
    out ahead of need (default 1/64 of the device).
    """

    def __init__(self, block_size: int, num_device_blocks: int, num_host_blocks: int = 0, *,
                 storage_lookup: StorageLookup | None = None, write_through: bool = False,
                 low_water: int | None = None):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.device_pool = BlockPool("device", num_device_blocks)
        self.host_pool = BlockPool("host", num_host_blocks)
        self.storage_lookup = storage_lookup
        self.write_through = write_through
        self.metrics = CacheMetrics()
        self.status = CacheStatus.NORMAL
        n = num_device_blocks + num_host_blocks + 1  # a live node holds at least one block
        self._f = np.repeat(_RESET[:, None], n, axis=1)  # the node matrix: a row per field
        row = [memoryview(r) for r in self._f]
        self._parent_v, self._child_v, self._dev_v, self._ref_v = row[PARENT], row[CHILD], row[DEV], row[REF]
        self._ndev_v = row[NDEV]    # children in GPU or SWAP2GPU
        self._state_v = row[STATE]
        self._cont_v = row[CONT]    # the continuation child, found by key compare, not in _map
        self._next_v, self._prev_v = row[NEXT], row[PREV]  # siblings; CHILD is the first child
        self._host_v = row[HOST]
        self._task = np.full(n, -1, dtype=np.int64)  # the in-flight task moving the node
        self._task_v = memoryview(self._task)
        self._keys: list[bytes | None] = [None] * n
        self._stack = np.arange(n - 1, 0, -1, dtype=np.int32)   # free node ids; top at the end
        self._stack_v = memoryview(self._stack)
        self._top = n - 1
        self._state_v[ROOT] = GPU
        self._ref_v[ROOT] = 1
        self._map: dict[bytes, int] = {}  # key -> node, for nodes that are not continuations
        self._dev_lru = EvictionQueue(n)   # unreferenced GPU nodes
        self._host_lru = EvictionQueue(n)  # CPU nodes
        self._reqs: dict[Hashable, _Request] = {}
        self._tasks: dict[int, _Task] = {}
        self._new_tasks: list[CacheTask] = []
        self._deferred: deque[_Task] = deque()  # swap-ins waiting for device blocks, FIFO
        self._deferred_need = 0
        self._task_ids = itertools.count(1)
        self._dev_cached = 0     # blocks held by nodes, per tier
        self._host_cached = 0
        self._dev_returning = 0  # device blocks that in-flight swap-outs free when done
        self._idle = 0           # unreferenced GPU nodes: what eviction can still free
        self._low_water = max(1, num_device_blocks // 64) if low_water is None else low_water
        self._storing: set[bytes] = set()  # keys of in-flight write-through tasks

    # ---- engine-facing API -------------------------------------------------------------------
    def match(self, request_id: Hashable, keys: Sequence[bytes], num_tokens: int,
              count: bool = True) -> MatchResult:
        """Start a request of `num_tokens` tokens whose full blocks have `keys`, and match its
        cached prefix. At least the last token is always left to compute (its logits are needed),
        so a prompt that matches entirely gives its last block back.

        `keys` must be chained (each key hashes its parent's key, as runtime/hashing.py makes
        them): a key is found only under the node of the key before it. `count=False` keeps the
        match out of the hit counters: a request matched again after preemption or after a
        failed allocation is still one request. If anything raises, the request is undone."""
        if request_id in self._reqs:
            raise ValueError(f"request {request_id!r} is already in the prefix cache")
        if num_tokens <= 0:
            raise ValueError(f"request {request_id!r}: num_tokens must be positive, got {num_tokens}")
        try:
            return self._match(request_id, keys, num_tokens, count)
        except BaseException:
            if request_id in self._reqs:
                self.release(request_id)
            raise

    def _match(self, request_id: Hashable, keys: Sequence[bytes], num_tokens: int,
               count: bool) -> MatchResult:
        bs = self.block_size
        normal = self.status is NORMAL
        req = _Request(keys, num_tokens, frozen=not normal, counted=count)
        self._reqs[request_id] = req
        limit = min(len(keys), (num_tokens - 1) // bs) if normal else 0
        path = self._walk(keys, limit)
        matched = len(path)
        dev_hits = host_hits = 0
        if matched:
            dev_hits, host_hits = self._touch(request_id, req, path)
        req.num_matched = matched
        storage_hits = 0
        if self.storage_lookup is not None and matched < limit:
            storage_hits = self._read_storage(request_id, req, keys[matched:limit])
        req.cached_tokens = len(req.path) * bs
        req.host_hits, req.storage_hits = host_hits, storage_hits
        if count:
            self._count_match(req, keys, limit, dev_hits, host_hits, storage_hits)
        return MatchResult(list(req.blocks), dev_hits * bs, host_hits * bs, storage_hits * bs,
                           sorted(req.waiting))

    def allocate(self, request_id: Hashable, num_tokens: int) -> list[int] | None:
        """Grow the request's block table to hold `num_tokens` tokens (prompt and any decode
        room); returns the new block ids, or None when the device cannot supply them now.

        None changes nothing when free and evictable blocks could not cover the request anyway
        (no flush of the cache for an allocation that fails regardless); when they could, it
        starts the evictions (swap-outs to the host tier finish later) and the retry after
        their results succeeds. The first allocation of a request queues behind deferred
        swap-ins (arrival order); a request already computing grows ahead of them, so a
        swap-in never waits for blocks the request it would block holds."""
        req = self._request(request_id)
        need = -(-num_tokens // self.block_size) - len(req.blocks)
        if need <= 0:
            return []
        got = self._take_device(need, urgent=req.admitted)
        if got is not None:
            req.blocks += got
            req.admitted = True
            self._swap_ahead()
        return got

    def _swap_ahead(self) -> None:
        """With a host tier, keep a few device blocks free or on their way back: a swap-out
        takes a round trip to the cache-transfer ranks, and a request that needs a block
        should not wait for one (nor anyone be preempted) while it is under way."""
        short = self._low_water - self.device_pool.num_free - self._dev_returning - self._deferred_need
        if short > 0 and self.host_pool.num_blocks and self._idle:
            self._evict_device(min(short, self._idle))

    def reclaimable(self, request_id: Hashable, num_tokens: int) -> bool:
        """Could `allocate(request_id, num_tokens)` succeed once in-flight tasks finish,
        without any other request giving up blocks? (Free blocks, blocks swap-outs are
        returning and unreferenced cached blocks cover it.) The scheduler waits then instead
        of preempting."""
        req = self._request(request_id)
        need = -(-num_tokens // self.block_size) - len(req.blocks)
        if not req.admitted:
            need += self._deferred_need
        return need <= self.device_pool.num_free + self._dev_returning + self._idle

    def waits_for_room(self, request_id: Hashable) -> bool:
        """Does the request wait for a deferred swap-in (one that has no device blocks yet)?
        Such a request only holds blocks; one whose transfers are under way will be ready."""
        waiting = self._request(request_id).waiting
        return bool(waiting) and any(t.task.task_id in waiting for t in self._deferred)

    @property
    def stalled_swap_ins(self) -> bool:
        """Deferred swap-ins exist and nothing in flight or evictable can make room for them:
        only a request giving up blocks can (the scheduler then preempts a loading request)."""
        return bool(self._deferred) and not self._dev_returning and (
            self._deferred_need > self.device_pool.num_free + self._idle)

    def update(self, request_id: Hashable, num_computed_tokens: int,
               keys: Sequence[bytes] | None = None) -> int:
        """Record that the KV of the request's first `num_computed_tokens` tokens is written:
        its full blocks up to there become matchable. `keys` replaces the request's key list
        when the request grew. Returns the tokens of the request now covered by the tree."""
        req = self._request(request_id)
        if keys is not None:
            req.keys = keys
        if req.waiting:
            raise RuntimeError(f"request {request_id!r} still waits for tasks {sorted(req.waiting)}")
        if num_computed_tokens > len(req.blocks) * self.block_size:
            raise ValueError(f"request {request_id!r}: {num_computed_tokens} tokens computed but "
                             f"only {len(req.blocks)} blocks allocated")
        n_full = min(num_computed_tokens // self.block_size, len(req.keys))
        if n_full > len(req.path) and not req.frozen and self.status is NORMAL:
            self._record(req, n_full)
        return len(req.path) * self.block_size

    def release(self, request_id: Hashable) -> None:
        """Finish a request: free its private blocks (partial last block, decode blocks, copies of
        blocks another request recorded first) and drop its references."""
        req = self._reqs.pop(request_id, None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not in the prefix cache")
        n = len(req.path)
        private = req.blocks[n:]
        if req.load >= 0:  # a storage read still writes into the next blocks: the task keeps them
            load = self._tasks[req.load]
            load.request = None
            private = req.blocks[n + len(load.task.device_blocks):]
        unwanted = []
        for task_id in req.waiting:
            t = self._tasks[task_id]
            t.waiters.discard(request_id)
            if not t.waiters and t in self._deferred:
                unwanted.append(t)
        private += req.dups
        self.device_pool.free(private)
        if self.write_through and self.status is NORMAL and n > req.num_matched:
            self._write_back(req)
        else:
            self._deref(req.path)
        for t in unwanted:  # (a request that adopted one of its nodes still holds it: keep it)
            if not any(self._ref_v[n] for n in t.nodes):
                self._cancel_deferred(t)
        self._pump_deferred()

    def block_table(self, request_id: Hashable) -> list[int]:
        """The request's device block ids in token order (final once the request is ready)."""
        return list(self._request(request_id).blocks)

    def is_ready(self, request_id: Hashable) -> bool:
        """True once no task the request waits for is in flight."""
        return not self._request(request_id).waiting

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the tree holds (any tier); no side effects."""
        return len(self._walk(keys, len(keys)))

    def take_tasks(self) -> list[CacheTask]:
        """Tasks created since the last call; the engine sends each to every cache-transfer rank."""
        out, self._new_tasks = self._new_tasks, []
        for task in out:
            self._tasks[task.task_id].issued = True
        return out

    def apply_task_result(self, task_id: int, ok: bool, blocks: int | None = None) -> TaskOutcome:
        """Apply a finished task. For STORAGE2GPU, `blocks` is how many leading blocks were read
        (default: all if ok, none if not); other kinds are all or nothing."""
        t = self._tasks.get(task_id)
        if t is None or not t.issued:
            raise ValueError(f"task {task_id} is not in flight")
        del self._tasks[task_id]
        out = TaskOutcome(t.task, ok)
        kind = t.task.kind
        if kind is TaskKind.SWAP2CPU:
            self._finish_swap_out(t, ok)
        elif kind is TaskKind.SWAP2GPU:
            self._finish_swap_in(t, ok, out)
        elif kind is TaskKind.STORAGE2GPU:
            n = len(t.task.device_blocks)
            loaded = (n if ok else 0) if blocks is None else max(0, min(blocks, n))
            self._finish_storage_read(t, loaded, out)
        else:
            self._deref(t.path)
            self._storing.difference_update(t.task.keys)
            if ok:
                self.metrics.storage_write_blocks += len(t.task.keys)
        if ok:
            self.metrics.tasks_done += 1
        else:
            self.metrics.tasks_failed += 1
            log.warning("%s task %d failed (%d blocks)", kind.value, task_id, len(t.task.device_blocks))
        if self.status is CacheStatus.CLEARING and not self._tasks:
            self._drop_all()
        self._pump_deferred()
        return out

    # ---- reset ---------------------------------------------------------------------------------
    def clear(self) -> CacheStatus:
        """Drop the whole tree (model weights change): CLEARING until every in-flight task has been
        applied, then CLEARED. Live requests keep their blocks but record nothing more."""
        if self.status in (CacheStatus.NORMAL, CacheStatus.UPDATING):
            self.status = CacheStatus.CLEARING
            for req in self._reqs.values():
                req.frozen = True
            if self._deferred:  # make room (by dropping) so the swap-ins they wait for can run
                self._take_device(0)
            if not self._tasks:
                self._drop_all()
        return self.status

    def begin_update(self) -> None:
        """CLEARED -> UPDATING: new weights are being loaded."""
        self._transition(CacheStatus.CLEARED, CacheStatus.UPDATING)

    def finish_update(self) -> None:
        """UPDATING -> NORMAL: caching resumes."""
        self._transition(CacheStatus.UPDATING, CacheStatus.NORMAL)

    def _transition(self, expected: CacheStatus, new: CacheStatus) -> None:
        if self.status is not expected:
            raise RuntimeError(f"prefix cache is {self.status.name}, not {expected.name}")
        self.status = new

    # ---- status --------------------------------------------------------------------------------
    def block_usage(self) -> dict[str, int]:
        """free / cached (held by tree nodes) / used (requests and tasks) / total, per tier."""
        out = {}
        for tier, pool, cached in (("device", self.device_pool, self._dev_cached),
                                   ("host", self.host_pool, self._host_cached)):
            out[f"{tier}_total"] = pool.num_blocks
            out[f"{tier}_free"] = pool.num_free
            out[f"{tier}_cached"] = cached
            out[f"{tier}_used"] = pool.num_blocks - pool.num_free - cached
        return out

    def block_roles(self) -> tuple[np.ndarray, np.ndarray]:
        """What every device and host block is for, as int8 arrays of ROLE_* codes: the truth
        the ownership race detector (KVRT_CHECK_OWNERSHIP=1) syncs its shared owner table from.

        Tasks not yet taken by the engine count as not started (their sources are still tree
        blocks, their destinations still free), so the engine can sync, then hand each new
        task's blocks over and have the hand-over check where they come from. O(blocks):
        debug mode only."""
        dev = np.full(self.device_pool.num_blocks, ROLE_PRIVATE, dtype=np.int8)
        host = np.full(self.host_pool.num_blocks, ROLE_PRIVATE, dtype=np.int8)
        for roles, row in ((dev, self._f[DEV]), (host, self._f[HOST])):
            live = (self._f[STATE] != FREE) & (self._f[STATE] != DETACHED) & (row >= 0)
            roles[row[live]] = ROLE_TREE
        dev[self.device_pool.free_blocks()] = ROLE_FREE
        host[self.host_pool.free_blocks()] = ROLE_FREE
        for t in self._tasks.values():
            reads, writes = _TASK_SIDES[t.task.kind]
            sides = {"device": (dev, t.task.device_blocks), "host": (host, t.task.host_blocks)}
            if t.issued and reads in sides:
                roles, blocks = sides[reads]
                roles[[b for b in blocks if b >= 0]] = ROLE_SAVING
            if writes in sides:
                roles, blocks = sides[writes]
                roles[[b for b in blocks if b >= 0]] = ROLE_LOADING if t.issued else ROLE_FREE
        return dev, host

    def snapshot(self) -> dict[str, float]:
        """Counters, rates and block usage as one flat dict (for status and Prometheus)."""
        out = self.metrics.snapshot()
        out.update(self.block_usage())
        out["nodes"] = int((self._f[STATE] <= SWAP2GPU).sum()) - 1  # in the tree, root aside
        out["requests_active"] = len(self._reqs)
        out["tasks_inflight"] = len(self._tasks)
        out["status"] = int(self.status)
        return out

    # ---- matching ------------------------------------------------------------------------------
    def _walk(self, keys: Sequence[bytes], limit: int) -> np.ndarray:
        """The tree nodes of keys[:limit]'s longest cached prefix, from the root down: follow
        each node's continuation while its key matches, ask the key map where it does not."""
        path = np.empty(limit, dtype=np.int32)
        out = memoryview(path)
        cont, node_keys, get, parent = self._cont_v, self._keys, self._map.get, self._parent_v
        n = ROOT
        i = 0
        for i in range(limit):
            key = keys[i]
            c = cont[n]
            if c < 0 or node_keys[c] != key:
                c = get(key)
                if c is None or parent[c] != n:  # (a key that was not chained: another branch)
                    return path[:i]
            out[i] = n = c
        return path[:limit]

    def _child(self, n: int, key: bytes) -> int:
        """n's child with `key`, or -1."""
        c = self._cont_v[n]
        if c >= 0 and self._keys[c] == key:
            return c
        c = self._map.get(key, -1)
        return c if c >= 0 and self._parent_v[c] == n else -1

    def _touch(self, request_id: Hashable, req: _Request, a: np.ndarray) -> tuple[int, int]:
        """Take a reference on each matched node (`a`) and make it usable by the request; sets
        the request's path and block table. Host hits get a swap-in, deferred (block table
        entries -1 until issued) when the device has no free blocks for it yet. Returns
        (device hits, host hits)."""
        f = self._f
        g = f[DEV:STATE + 1, a]
        refs = g[REF - DEV]
        f[REF, a] = refs + 1
        self._dev_lru.discard(a)
        st = g[STATE - DEV]
        unused = refs == 0
        if not st.any():  # all on the device: the common case, fully vectorised
            self._idle -= int(np.count_nonzero(unused))
            req.path = a
            req.blocks = g[0].tolist()
            return len(a), 0
        self._idle -= int(np.count_nonzero(unused & (st == GPU)))
        self._host_lru.discard(a)  # before eviction below can pick a host hit
        states = st.tolist()
        ncpu = states.count(CPU)
        # destinations for the swap-ins; None: deferred until swap-outs return device blocks
        dest = self._take_device(ncpu) if ncpu else []
        path = a.tolist()
        swap_in = []
        dev_hits = host_hits = 0
        for n, s in zip(path, states):
            if s == GPU:
                dev_hits += 1
            elif s == SWAP2CPU:
                self._flip_back(n)
                dev_hits += 1
            elif s == CPU:
                self._start_swap_in(n, dest[len(swap_in)] if dest is not None else -1)
                swap_in.append(n)
                host_hits += 1
            else:  # SWAP2GPU: wait for the swap-in already under way
                task_id = self._task_v[n]
                self._tasks[task_id].waiters.add(request_id)
                req.waiting.add(task_id)
                host_hits += 1
        if swap_in:
            t = self._new_task(TaskKind.SWAP2GPU, swap_in, dest or [],
                               [self._host_v[n] for n in swap_in], issue=dest is not None)
            for n in swap_in:
                self._task_v[n] = t.task.task_id
            if dest is None:
                self._deferred.append(t)
                self._deferred_need += len(swap_in)
            t.waiters.add(request_id)
            req.waiting.add(t.task.task_id)
            self.metrics.swap_in_blocks += len(swap_in)
        req.path = a
        req.blocks = f[DEV, a].tolist()
        return dev_hits, host_hits

    def _cancel_deferred(self, t: _Task) -> None:
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

    def _start_swap_in(self, n: int, dev_block: int) -> None:
        if dev_block >= 0:
            self._dev_v[n] = dev_block
            self._dev_cached += 1
        self._state_v[n] = SWAP2GPU
        self._ndev_v[self._parent_v[n]] += 1

    def _flip_back(self, n: int) -> None:
        """A SWAP2CPU node is wanted again: it is GPU at once (its device copy never stopped
        being valid); the host block goes to its task, which frees it when it reports."""
        t = self._tasks[self._task_v[n]]
        t.orphans.append(self._host_v[n])
        self._host_v[n] = -1
        self._host_cached -= 1
        self._task_v[n] = -1
        self._state_v[n] = GPU
        self._dev_returning -= 1
        self._ndev_v[self._parent_v[n]] += 1
        self.metrics.swap_out_cancelled += 1

    def _read_storage(self, request_id: Hashable, req: _Request, rest: Sequence[bytes]) -> int:
        """Look the keys after the tree's match up in storage; read the hits into new device
        blocks (a STORAGE2GPU task the request waits for). Returns the blocks to be read."""
        try:
            hits = max(0, min(int(self.storage_lookup(rest)), len(rest)))
        except Exception as e:  # the storage tier is an optimisation: a failing lookup is a miss
            log.warning("storage lookup failed, treated as a miss: %s", e)
            hits = 0
        if not hits:
            return 0
        dest = self._take_device(hits)
        if dest is None:
            return 0
        t = self._new_task(TaskKind.STORAGE2GPU, [], dest, [], list(rest[:hits]))
        t.request = request_id
        req.blocks += dest
        req.load = t.task.task_id
        req.waiting.add(req.load)
        return hits

    def _count_match(self, req: _Request, keys: Sequence[bytes], limit: int, dev_hits: int,
                     host_hits: int, storage_hits: int) -> None:
        m, bs, n = self.metrics, self.block_size, req.num_tokens
        m.requests += 1
        m.query_tokens += n
        m.query_tokens_host += n - dev_hits * bs
        m.query_tokens_storage += n - (dev_hits + host_hits) * bs
        m.hit_tokens_device += dev_hits * bs
        m.hit_tokens_host += host_hits * bs
        m.hit_tokens_storage += storage_hits * bs
        if dev_hits or host_hits or storage_hits:
            m.hit_requests += 1
        matched = len(req.path)
        if matched == limit and self.status is NORMAL:
            last = int(req.path[-1]) if matched else ROOT
            if n % bs == 0 and limit < len(keys) and self._child(last, keys[limit]) >= 0:
                m.backoff_tokens += bs
            elif n % bs and limit == n // bs:
                if self._child_v[last] >= 0:
                    m.partial_block_tokens += n % bs

    # ---- recording -----------------------------------------------------------------------------
    def _record(self, req: _Request, n_full: int) -> None:
        """Put the request's blocks [len(path), n_full) into the tree under its path."""
        path = req.path
        i0 = len(path)
        parent = int(path[-1]) if i0 else ROOT
        if self._state_v[parent] == DETACHED:
            req.frozen = True
            return
        keys = req.keys[i0:n_full]
        blocks = req.blocks[i0:n_full]
        k = len(keys)
        top = self._top
        ids = self._stack[top - k:top].copy()
        self._top = top - k
        cand = ids.tolist()
        if self._child(parent, keys[0]) < 0:  # then no later key is in the tree either
            self._new_chain(parent, ids, cand, keys, blocks)
        else:
            ids = np.array(self._record_slow(req, parent, cand, keys, blocks, i0), dtype=np.int32)
        req.path = np.concatenate((path, ids))

    def _new_chain(self, parent: int, ids: np.ndarray, cand: list[int], keys: list[bytes],
                   blocks: list[int]) -> None:
        deque(map(self._keys.__setitem__, cand, keys), maxlen=0)
        new = np.empty((NEW_ROWS, len(cand)), dtype=np.int32)
        new[PARENT, 0] = parent
        new[PARENT, 1:] = ids[:-1]
        new[CHILD, :-1] = ids[1:]
        new[CHILD, -1] = -1
        new[DEV] = blocks
        new[REF] = 1
        new[NDEV] = 1  # each node's one child is the next, on the device
        new[NDEV, -1] = 0
        new[STATE] = GPU
        new[CONT] = new[CHILD]
        self._f[:NEW_ROWS, ids] = new
        self._link(cand[0], keys[0], parent)
        self._ndev_v[parent] += 1
        self._dev_cached += len(cand)

    def _record_slow(self, req: _Request, parent: int, cand: list[int], keys: list[bytes],
                     blocks: list[int], i0: int) -> list[int]:
        """Some keys were already in the tree (another request computed the same blocks first):
        adopt those nodes, create the rest, give unused node ids back. Returns the nodes.

        Where the node's device copy is readable, the request reads it from now on and its own
        copy is freed: holding both would make a request that fits the device alone need more
        than the device (its copies plus the pinned originals)."""
        got = []
        unused = []
        copies = []
        for j, (key, c, b) in enumerate(zip(keys, cand, blocks)):
            g = self._child(parent, key)
            if g < 0:
                self._new_node(c, key, parent, b)
                g = c
            else:
                unused.append(c)
                if not self._adopt(g, b):
                    if self._state_v[g] == GPU:
                        req.blocks[i0 + j] = self._dev_v[g]
                        copies.append(b)
                    else:  # still being swapped in: the request keeps reading its own copy
                        req.dups.append(b)
            got.append(g)
            parent = g
        self._push_ids(unused)
        self.device_pool.free(copies)
        return got

    def _new_node(self, n: int, key: bytes, parent: int, dev_block: int) -> None:
        self._keys[n] = key
        self._dev_v[n] = dev_block
        self._ref_v[n] = 1
        self._state_v[n] = GPU
        self._link(n, key, parent)
        self._ndev_v[parent] += 1
        self._dev_cached += 1

    def _adopt(self, n: int, dev_block: int) -> bool:
        """Reference an existing node for a block the request computed itself. A host-only node
        takes the request's fresh device copy (True: the block now belongs to the node);
        otherwise the request keeps its copy privately (False)."""
        s = self._state_v[n]
        refs = self._ref_v[n]
        self._ref_v[n] = refs + 1
        if s == GPU:
            self._idle -= refs == 0
            self._dev_lru.discard_one(n)
        elif s == SWAP2CPU:
            self._flip_back(n)
        elif s == CPU:
            self._host_lru.discard_one(n)
            self.host_pool.free([self._host_v[n]])
            self._host_v[n] = -1
            self._host_cached -= 1
            self._dev_v[n] = dev_block
            self._dev_cached += 1
            self._state_v[n] = GPU
            self._ndev_v[self._parent_v[n]] += 1
            return True
        return False

    def _write_back(self, req: _Request) -> None:
        """Write-through: store the blocks this request computed; the task keeps the request's
        references (the whole path, so LRU order stays ancestors-after-descendants) until done."""
        """Blocks already stored, or being stored for another request that computed them too,
        are not written again."""
        stored, storing, keys = self.storage_lookup, self._storing, self._keys
        own = [n for n in req.path[req.num_matched:].tolist() if self._state_v[n] == GPU
               and keys[n] not in storing and not stored([keys[n]])]
        if not own:
            self._deref(req.path)
            return
        t = self._new_task(TaskKind.GPU2STORAGE, [], [self._dev_v[n] for n in own], [],
                           [keys[n] for n in own])
        storing.update(t.task.keys)
        t.path = req.path

    # ---- references ----------------------------------------------------------------------------
    def _deref(self, path: np.ndarray) -> None:
        """Drop one reference along `path`; nodes left unreferenced become evictable, tail first
        so that a chain's deepest block is evicted first."""
        if not len(path):
            return
        a = path[::-1]
        f = self._f
        r = f[REF, a] - 1
        f[REF, a] = r
        zero = a[r == 0]
        if not len(zero):
            return
        st = f[STATE, zero]
        if not st.any():
            self._dev_lru.push(zero)
            self._idle += len(zero)
            return
        on_device = zero[st == GPU]
        self._dev_lru.push(on_device)
        self._idle += len(on_device)
        devs: list[int] = []
        hosts: list[int] = []
        for n in zero[st == DETACHED].tolist():
            if self._task_v[n] < 0:
                self._free_node(n, devs, hosts)
        # SWAP2CPU / SWAP2GPU: their task's result queues them
        self.device_pool.free(devs)
        self.host_pool.free(hosts)

    # ---- allocation and eviction ---------------------------------------------------------------
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

    def _pump_deferred(self) -> None:
        """Issue deferred swap-ins that fit, and start the evictions the rest need (a deferred
        swap-in whose request just waits must not depend on some other allocation to make its
        room)."""
        self._start_deferred()
        short = self._deferred_need - self.device_pool.num_free - self._dev_returning
        if self._deferred and 0 < short <= self._idle:
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

    def _evict_device(self, n: int) -> None:
        """Evict up to `n` device blocks, least recently used leaves first: to host blocks (a
        SWAP2CPU task) while any can be had, else dropped."""
        pop = self._dev_lru.pop
        swap = self.host_pool.num_blocks > 0 and self.status is NORMAL
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

    def _device_child_gone(self, p: int) -> None:
        """One of p's children left the device; p may now be an evictable device leaf."""
        left = self._ndev_v[p] - 1
        self._ndev_v[p] = left
        if (left == 0 and self._state_v[p] == GPU and self._ref_v[p] == 0
                and p not in self._dev_lru):
            self._dev_lru.push_front(p)

    # ---- tree surgery --------------------------------------------------------------------------
    def _link(self, n: int, key: bytes, parent: int) -> None:
        """Make n (with `key`) the first child of parent, and its continuation if it has none;
        otherwise n is found through the key map."""
        if self._cont_v[parent] < 0:
            self._cont_v[parent] = n
        else:
            self._map[key] = n
        head = self._child_v[parent]
        self._parent_v[n] = parent
        self._prev_v[n] = -1
        self._next_v[n] = head
        if head >= 0:
            self._prev_v[head] = n
        self._child_v[parent] = n

    def _unlink(self, n: int) -> None:
        """Take n out of its parent's children and out of the key map, updating the parent's
        leaf status."""
        p = self._parent_v[n]
        if self._cont_v[p] == n:
            self._cont_v[p] = -1
        else:
            del self._map[self._keys[n]]
        before, after = self._prev_v[n], self._next_v[n]
        if before >= 0:
            self._next_v[before] = after
        else:
            self._child_v[p] = after
        if after >= 0:
            self._prev_v[after] = before
        if self._state_v[n] in (GPU, SWAP2GPU):
            self._device_child_gone(p)
        if self._child_v[p] < 0:
            self._host_leaf_again(p)

    def _host_leaf_again(self, p: int) -> None:
        """p's last child left; an unreferenced CPU node is now an evictable host leaf. (A CPU
        node is referenced only inside `match`, between being matched and its swap-in starting.)"""
        if self._state_v[p] == CPU and self._ref_v[p] == 0 and p not in self._host_lru:
            self._host_lru.push_front(p)

    def _drop_subtree(self, v: int, devs: list[int], hosts: list[int]) -> None:
        """Remove v and everything below it from the tree. Unreferenced nodes with no task in
        flight are freed (their blocks appended to devs / hosts); the others are DETACHED: they
        keep their blocks until their references and task drain."""
        self._unlink(v)
        if self._child_v[v] < 0 and self._ref_v[v] == 0 and self._task_v[v] < 0:  # a leaf: usual
            self._free_node(v, devs, hosts)
            return
        nodes = []
        stack = [v]
        while stack:  # collect first: freeing a node resets the links its children are found by
            n = stack.pop()
            nodes.append(n)
            c = self._child_v[n]
            while c >= 0:
                if self._cont_v[n] != c:
                    del self._map[self._keys[c]]
                stack.append(c)
                c = self._next_v[c]
        for n in nodes:
            if self._ref_v[n] == 0 and self._task_v[n] < 0:
                self._free_node(n, devs, hosts)
            else:
                self._detach(n)

    def _detach(self, n: int) -> None:
        """Out of the tree but still held: its blocks count as in use, not cached."""
        self._dev_cached -= self._dev_v[n] >= 0
        self._host_cached -= self._host_v[n] >= 0
        self._dev_lru.discard_one(n)
        self._host_lru.discard_one(n)
        self._keys[n] = None
        self._state_v[n] = DETACHED
        self._parent_v[n] = self._child_v[n] = self._next_v[n] = self._prev_v[n] = -1
        self._cont_v[n] = -1
        self._ndev_v[n] = 0

    def _free_node(self, n: int, devs: list[int], hosts: list[int]) -> None:
        """Give n's blocks to the batches `devs` / `hosts` and its id back to the stack. Every
        field is reset here, so a node id on the stack is clean and creating a node writes only
        the fields that differ (the checker verifies this)."""
        state = self._state_v[n]
        cached = state != DETACHED
        if state == GPU and self._ref_v[n] == 0:
            self._idle -= 1
        d = self._dev_v[n]
        if d >= 0:
            devs.append(d)
            self._dev_cached -= cached
        h = self._host_v[n]
        if h >= 0:
            hosts.append(h)
            self._host_cached -= cached
        self._dev_lru.discard_one(n)
        self._host_lru.discard_one(n)
        self._keys[n] = None
        self._parent_v[n] = self._child_v[n] = self._dev_v[n] = self._host_v[n] = -1
        self._next_v[n] = self._prev_v[n] = self._cont_v[n] = -1
        self._ref_v[n] = self._ndev_v[n] = 0
        self._state_v[n] = FREE
        self._task_v[n] = -1
        self._stack_v[self._top] = n
        self._top += 1

    def _push_ids(self, ids: list[int]) -> None:
        """Return node ids that were taken but never used (their fields were never written)."""
        top = self._top
        self._stack[top:top + len(ids)] = ids
        self._top = top + len(ids)

    def _drop_all(self) -> None:
        """CLEARING with nothing in flight: drop every node. Referenced ones are DETACHED (their
        requests still use the blocks); the rest are freed in one vectorised pass."""
        f = self._f
        live = np.nonzero(f[STATE] != FREE)[0]
        live = live[(live != ROOT) & (f[STATE, live] != DETACHED)]
        held = live[f[REF, live] > 0]
        gone = live[f[REF, live] == 0]
        for n in held.tolist():
            self._detach(n)
        devs = f[DEV, gone]
        hosts = f[HOST, gone]
        self.device_pool.free(devs[devs >= 0].tolist())
        self.host_pool.free(hosts[hosts >= 0].tolist())
        self._dev_cached -= int((devs >= 0).sum())
        self._host_cached -= int((hosts >= 0).sum())
        f[:, gone] = _RESET[:, None]
        self._task[gone] = -1
        for n in gone.tolist():
            self._keys[n] = None
        self._push_ids(gone.tolist())
        self._child_v[ROOT] = self._cont_v[ROOT] = -1
        self._ndev_v[ROOT] = 0
        self._map.clear()
        self._idle = 0
        self._dev_lru.clear()
        self._host_lru.clear()
        self.status = CacheStatus.CLEARED
        log.info("prefix cache cleared: %d nodes freed, %d detached until released",
                 len(gone), len(held))

    # ---- tasks ---------------------------------------------------------------------------------
    def _new_task(self, kind: TaskKind, nodes: list[int], device_blocks: list[int],
                  host_blocks: list[int], keys: list[bytes] | None = None, issue: bool = True,
                  task_id: int = -1) -> _Task:
        if keys is None:
            keys = [self._keys[n] for n in nodes]
        if task_id < 0:
            task_id = next(self._task_ids)
        task = CacheTask(task_id, kind, device_blocks, host_blocks, keys)
        t = _Task(task, nodes)
        self._tasks[task.task_id] = t
        if issue:
            self._new_tasks.append(task)
        return t

    def _finish_swap_out(self, t: _Task, ok: bool) -> None:
        """Done: the node is CPU and its device block is free. Failed: the node is dropped
        (with its host-only descendants) and both its blocks are free: the swap-out was asked
        for to free device blocks, and a host tier that fails or times out must not have the
        same blocks offered to it again and again while requests wait for them. Nodes matched
        again meanwhile were already GPU; their host blocks are the task's orphans."""
        task_id = t.task.task_id
        devs: list[int] = []
        hosts = t.orphans
        on_host: list[int] = []
        for n in t.nodes:
            if self._task_v[n] != task_id:
                continue  # flipped back (and perhaps evicted again by a newer task)
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
            else:
                self._drop_subtree(n, devs, hosts)
        self._host_lru.push(np.array(on_host, dtype=np.int32))
        self.device_pool.free(devs)
        self.host_pool.free(hosts)

    def _finish_swap_in(self, t: _Task, ok: bool, out: TaskOutcome) -> None:
        """Done: the nodes are GPU and their host blocks free. Failed: the nodes and everything
        below them leave the tree, and the requests waiting for them fail."""
        devs: list[int] = []
        hosts: list[int] = []
        for n in t.nodes:
            self._task_v[n] = -1
        for n in t.nodes:
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

    def _finish_storage_read(self, t: _Task, loaded: int, out: TaskOutcome) -> None:
        """The first `loaded` blocks hold their KV: they enter the tree like computed blocks.
        The rest stay private to the request, which computes them."""
        rid = t.request
        if rid is None:  # the request left meanwhile: the blocks were the task's to free
            self.device_pool.free(t.task.device_blocks)
            return
        req = self._reqs[rid]
        req.load = -1
        req.waiting.discard(t.task.task_id)
        self.metrics.storage_read_blocks += loaded
        if req.counted:  # the hit counters count what was read, not what was hoped for
            self.metrics.hit_tokens_storage -= (len(t.task.device_blocks) - loaded) * self.block_size
        if loaded:
            req.cached_tokens += loaded * self.block_size
            if not req.frozen and self.status is NORMAL:
                self._record(req, len(req.path) + loaded)
                req.num_matched = len(req.path)  # read, not computed: not written back
        if not req.waiting:
            out.ready[rid] = req.cached_tokens

    def _request(self, request_id: Hashable) -> _Request:
        try:
            return self._reqs[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not in the prefix cache") from None

    # ---- invariants ----------------------------------------------------------------------------
    def check(self) -> dict[str, int]:
        """Assert the cache's invariants (O(blocks); for tests and debug runs): per tier every
        block is exactly one of free, cached (held by a node) or in use (a request's private
        block, a task's), and free + cached + used = total; the tree, its key map, reference
        counts and LRU lists agree. Returns block_usage()."""
        _Checker(self).run()
        return self.block_usage()


class _Checker:
    """The invariant checker behind PrefixCache.check (kept apart: it reads everything)."""

    def __init__(self, cache: PrefixCache):
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

    def _ids(self, live: list[int]) -> None:
        c = self.c
        free_ids = c._stack[:c._top].tolist()
        every = free_ids + live + [ROOT]
        _expect(len(every) == len(set(every)) == c._f.shape[1],
                f"node ids: {len(free_ids)} free + {len(live)} live + root != {c._f.shape[1]} "
                f"or an id is both free and live")
        ids = c._stack[:c._top]
        clean = ((c._f[:, ids] == _RESET[:, None]).all() and (c._task[ids] == -1).all()
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
            if state[n] == GPU and c._ref_v[n] == 0 and c._ndev_v[n] == 0:
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
            skip = len(c._tasks[req.load].task.device_blocks) if req.load >= 0 else 0
            dev_used += req.blocks[len(req.path) + skip:] + req.dups
        for t in c._tasks.values():
            if t.task.kind is TaskKind.STORAGE2GPU:
                dev_used += t.task.device_blocks
            host_used += t.orphans
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
