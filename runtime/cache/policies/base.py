"""The interface between the prefix cache and its eviction policy.

The cache keeps one queue per tier of the nodes eviction may take (device: unreferenced GPU
nodes; host: CPU nodes) and tells it every change; the policy decides only the order in which
`pop` hands them out. Reuse order held to what it has won against LRU, block by block
(runtime/cache/policies/adaptive.py) is a node's default (`--eviction adaptive`); age, reuse and
reuse gap (runtime/cache/policies/gaps.py, unbounded), age and reuse (runtime/cache/policies/reuse.py) and LRU over leaves
(runtime/cache/policies/lru.py) are the others. Another policy is one new file with a subclass of
`EvictionPolicy`, passed as `PrefixCache(..., policy=TheClass)`, and named in `_POLICIES` so that
`--eviction NAME` picks it.

What the cache guarantees and expects, whatever the policy:
- `push` gets the nodes a request released, deepest first, so a policy that keeps that order
  evicts leaves before their ancestors; the cache skips (parks) a popped node that still has
  children on the device, and gives it back through `push_front` when it becomes a leaf again.
- The calls sit on the cache's hot paths (every matched and released path, every evicted
  block): a policy must be O(1) per node amortised (O(log n) per batch at most), and batch calls
  take numpy arrays.
- Besides `pop`, a policy hands out runs: `pop_many(k) -> np.ndarray`, the next `k` nodes
  (fewer if the queue runs out), exactly as `k` calls of `pop` would return them. The cache
  evicts whole runs at once (runtime/cache/eviction.py), which is what makes eviction about as
  cheap per block as recording.
"""
from __future__ import annotations

import importlib

import numpy as np


class EvictionPolicy:
    """One tier's evictable nodes, in the order they are to be evicted.

    A policy declares what more it needs from the cache, as class attributes the cache reads
    once, when it is built (never probing for methods):
    - `counts_uses = True`: the cache also counts, for every block a request recorded, the
      earlier requests that used its key while it was not cached (a count sketch,
      runtime/cache/use_sketch.py), so `hits` carries a block's history past its eviction;
    - `counts_gaps = True` (with `counts_uses`): the device tier's policy is told through
      `recorded` how many requests ago each computed node's key was last used;
    - `remembers = True`: the policy remembers blocks gone from the cache itself: the cache
      calls the device tier's `forget` with the nodes it drops (either tier) before their keys
      go, and its `recall` at every counted match for the keys after the matched prefix, and
      gives the nodes it records the uses recalled (`hits`) and their ages (`recorded`);
    - `sees_misses = True` (with `remembers`): the device tier's policy is told, through
      `missed`, of every counted request's blocks after its matched prefix and how many
      releases ago their keys were last used.
    The methods with a body are defaults a policy may replace with a faster or fuller one."""

    counts_uses = False
    counts_gaps = False
    remembers = False
    sees_misses = False

    __slots__ = ()

    def __init__(self, capacity: int, hits: np.ndarray) -> None:
        """A queue for node ids 0 .. capacity-1. `hits[n]` is how many matches reused node `n`
        since it was created (the node matrix's row, kept up to date by the cache; read only):
        a policy that ranks by reuse reads it when a node is pushed."""

    def __contains__(self, n: int) -> bool:
        """Is node `n` queued?"""
        raise NotImplementedError

    def push(self, nodes: np.ndarray) -> None:
        """Nodes that became evictable (released, or moved to this tier), deepest first; the
        policy keeps the array (the caller does not modify it). A queued node is re-queued."""
        raise NotImplementedError

    def push_front(self, n: int) -> None:
        """Node `n` (not queued) became a leaf again: it may be evicted next."""
        raise NotImplementedError

    def push_front_run(self, nodes: list[int]) -> None:
        """`push_front` of each of `nodes` (none queued), the last one first, so that they come
        back in this order: the rest of an eviction run that was cut short."""
        for n in reversed(nodes):
            self.push_front(n)

    def recorded(self, nodes: np.ndarray, ages: np.ndarray) -> None:
        """`nodes` (a path, root side first) were just computed; their keys were last used
        `ages` requests ago (-1: unknown). Called only on a policy that `counts_gaps`."""

    def forget(self, nodes: np.ndarray, keys: list, hits: np.ndarray | None = None) -> None:
        """`nodes` leave the cache: keys[i] and hits[i] are nodes[i]'s key and reuse count when
        `hits` is given (taken before they were freed), else keys is the node keys (keys[n] is
        node n's). Called only on a policy that `remembers`."""

    def remember_into(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Where an eviction run in C writes what `forget` would (runtime/cache/_cache_core.c
        drop_chains: the policy's per-node records, its table of keys gone and a mark set once
        anything is in it), or None if only `forget` itself can. Called only on a policy that
        `remembers`."""
        return None

    def recall(self, keys: list[bytes], start: int) -> tuple[np.ndarray, np.ndarray] | None:
        """For keys[start:]: releases since each was last used (-1: unknown) and its uses (int32),
        or None if none is known. Called only on a policy that `remembers`."""
        raise NotImplementedError

    def missed(self, ages: np.ndarray, usable: int) -> None:
        """A counted request could use its first `usable` blocks; the last len(ages) of them were
        not matched, and their keys were last used `ages` requests ago (-1: not known to have
        been). Called only on the device tier's policy, if it `sees_misses`."""

    def follows(self, leader: EvictionPolicy) -> None:
        """This queue is the host tier's; `leader` is the device tier's (same class). Called once,
        when the cache is built: a policy that steers by what requests miss, which only the
        device tier's is told, may follow it."""

    def discard(self, nodes: np.ndarray) -> None:
        """Take `nodes` out (queued or not): they are in use again."""
        raise NotImplementedError

    def discard_one(self, n: int) -> None:
        """`discard` for one node."""
        raise NotImplementedError

    def pop(self) -> int:
        """The next node to evict, taken out of the queue; -1 if none is queued."""
        raise NotImplementedError

    def pop_many(self, k: int) -> np.ndarray:
        """The next `k` nodes (int32; fewer if the queue runs out), taken out of the queue
        exactly as `k` calls of `pop` would take them."""
        raise NotImplementedError

    def parks(self, nodes: list[int]) -> None:
        """The cache will park any of `nodes` the next `pop_many` hands out (a swap-out still
        reads its block), as it parks one that `pop` hands out: a policy that decides by which
        device children a node still has counts these as staying. Nothing to do for most."""

    def members(self) -> list[int]:
        """The queued nodes in eviction order (for the invariant checker)."""
        raise NotImplementedError

    def stamped(self) -> list[int]:
        """The nodes the policy's own bookkeeping says are queued (for the invariant checker:
        must equal `members()` as a set)."""
        raise NotImplementedError


def policy_names() -> list[str]:
    """The names `--eviction` accepts, the default first."""
    return list(_POLICIES)


def make_policy(name: str) -> type[EvictionPolicy]:
    """The policy class named `name` (one of `policy_names()`)."""
    try:
        module, cls = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r} (known: {', '.join(_POLICIES)})") from None
    return getattr(importlib.import_module(module, __package__), cls)


# name -> (module, class); imported on demand, so a policy's module is loaded only when chosen
_POLICIES = {"adaptive": ("kvrt.runtime.cache.policies.adaptive", "Adaptive"),
             "gaps": ("kvrt.runtime.cache.policies.gaps", "ReuseGaps"),
             "reuse": ("kvrt.runtime.cache.policies.reuse", "ReuseLevels"),
             "lru": ("kvrt.runtime.cache.policies.lru", "EvictionQueue")}
