"""The prefix cache's C inner loops (runtime/cache/_cache_core.c) leave the cache exactly as the numpy
code they replace does (tests/runtime/cache/cache_reference.py): the same node matrix, keys, key map and queues
after every request of a workload with shared prefixes, branches and eviction, the production
code run once with each C function and once with its reference in its place."""
from __future__ import annotations

import functools
import heapq

import numpy as np
import pytest
import xxhash

from kvrt.runtime.cache import (eviction as cache_eviction, keys as hashing, match as cache_match,
                                prefix_cache as cache_prefix, tasks as cache_tasks, use_sketch)
from kvrt.runtime.cache._cache_core import deref, drop_run, free_host_nodes, mark_swap_out, record_chain, touch_device
from kvrt.runtime.cache.keys import BlockHasher
from kvrt.runtime.cache.nodes import CHILD, CONT, CPU, DETACHED, DEV, GPU, HITS, NDEV, NEXT, PARENT, PREV, REF, STATE
from kvrt.runtime.cache.policies import adaptive, gaps as reuse_gaps, reuse as reuse_levels
from kvrt.runtime.cache.policies.base import make_policy
from kvrt.runtime.cache.prefix_cache import PrefixCache
from tests.runtime.cache import cache_reference as ref
from tests.runtime.cache.test_eviction_policies import _workload

BS = 4


def _settle(c: PrefixCache) -> None:
    while tasks := c.take_tasks():
        for t in tasks:
            c.apply_task_result(t.task_id, True)


def _policy_state(q) -> dict:
    """A policy's own bookkeeping: its scalars (clock, moving sums, weight...) exactly and its
    per-node arrays (priorities, stamps, release times...), by slot, as a 128-bit digest of their
    bytes (a comparison as exact as their items', short of a digest collision; the bytes
    themselves, kept for every step of a replay, took gigabytes and most of the test's time)."""
    out = {}
    for cls in type(q).__mro__:
        for name in getattr(cls, "__slots__", ()):
            v = getattr(q, name, None)
            if isinstance(v, np.ndarray):
                out[name] = (v.dtype.str, v.shape, xxhash.xxh3_128_digest(np.ascontiguousarray(v)))
            elif isinstance(v, (int, float, bool)):
                out[name] = v
    return out


def _replay(c: PrefixCache, seed: int) -> list:
    """Requests over a few prefixes with random tails, one at a time; the cache's state after each."""
    rng = np.random.default_rng(seed)
    bases = [rng.integers(0, 1 << 20, 120).astype(np.int32) for _ in range(3)]
    states = []
    for i in range(150):
        base = bases[int(rng.integers(0, 3))][:int(rng.integers(0, 120))]
        tokens = np.concatenate([base, rng.integers(0, 1 << 20, int(rng.integers(1, 40))).astype(np.int32)])
        if not c.match(i, BlockHasher(BS).update(tokens), len(tokens)).ready:
            _settle(c)
        if c.allocate(i, len(tokens)) is None:
            _settle(c)
        if c.is_ready(i) and c.allocate(i, len(tokens)) is not None:
            c.update(i, len(tokens))
        c.release(i)
        _settle(c)
        states.append((c._f.copy(), list(c._keys), dict(c._map), c._dev_lru.members(), c._host_lru.members(),
                       _policy_state(c._dev_lru), _policy_state(c._host_lru), c.snapshot()))
    c.check()
    return states


# The replays with every C function in place, which each test compares one reference against:
# the same for every function tested, so run once per policy, host tier and seed (per pytest
# process), not once per function. Tests only read them.
@functools.cache
def _c_replay(name: str, host: int, seed: int) -> list:
    return _replay(PrefixCache(BS, 200, host, policy=make_policy(name)), seed)


@functools.cache
def _c_host_replay(name: str) -> list:
    return _host_replay(make_policy(name))


# the policies whose cache calls these C functions (the others: all of them): LRU keeps no use
# counts and has a queue of its own, and so does `adaptive` (runtime/cache/_cache_core.c
# adapt_*: it remembers blocks gone from the cache itself, no use sketch); only `gaps` ranks
# with gaps_rank, and `reuse` splits a released path its own way
POLICIES_USING = {"_add_c": ("gaps", "reuse"), "_raise_c": ("gaps", "reuse"),
                  "_pop_c": ("gaps", "reuse"),
                  "_stamp_runs_c": ("reuse",), "_release_c": ("gaps", "reuse"),
                  "_discard_c": ("gaps", "reuse"), "_rank_c": ("gaps",),
                  "_ghost_c": ("gaps",), "_give_uses_c": ("adaptive",)}


@pytest.mark.parametrize("name", ["adaptive", "gaps", "reuse", "lru"])
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("host", [0, 300])
@pytest.mark.parametrize("module,attr,reference", [
    pytest.param(module, attr, reference, id=attr) for module, attr, reference in (
        (cache_match, "_record_chain_c", ref.record_chain), (cache_eviction, "_drop_run_c", ref.drop_run),
        (cache_eviction, "_drop_chains_c", ref.drop_chains),
        (cache_match, "_touch_c", ref.touch_device), (cache_match, "_deref_c", ref.deref),
        (use_sketch, "_raise_c", ref.sketch_raise), (cache_eviction, "_chain_tops_c", ref.chain_tops),
        (reuse_levels, "_pop_c", ref.pop_live), (reuse_levels, "_stamp_runs_c", ref.stamp_runs),
        (cache_match, "_walk_c", ref.walk),
        (use_sketch, "_add_c", ref.sketch_add), (hashing, "_chain_keys_c", ref.chain_keys),
        (reuse_levels, "_release_c", ref.policy_release), (reuse_levels, "_discard_c", ref.policy_discard),
        (reuse_gaps, "_rank_c", ref.gaps_rank), (reuse_gaps, "_ghost_c", ref.ghost_ages),
        (cache_prefix, "_give_uses_c", ref.give_uses))])
def test_c_node_work_equals_numpy(name, seed, host, module, attr, reference, monkeypatch):
    """Matching (walk), recording a new chain and linking it under its parent (record_chain), telling whole chains in an eviction run (chain_tops)
    and dropping such a run (drop_run, the batched path without a host tier), referencing a matched path (touch_device, all on the device; a path
    with host hits takes the general path), releasing one (deref), counting a request's keys
    in the use sketch (sketch_add, stamping when each was last used too) and giving recorded blocks the uses the
    sketch remembers (sketch_raise, the `reuse` policy), the `reuse` policy's scan of its
    queue for a run (pop_live: its heap walk) and split of a released path into runs (stamp_runs), the
    `reuse` family's marks per released and matched node (policy_release, policy_discard) and
    the `gaps` ranking of a released path (gaps_rank) and ages of recorded nodes (ghost_ages), the uses
    `adaptive` recalled given to recorded nodes (give_uses), and the
    block keys themselves (chain_keys), in C or in numpy leave the same cache (and queues) at every step,
    with and without a host tier."""
    cls = make_policy(name)
    fast = _c_replay(name, host, seed)
    calls = []

    def counted(*args):
        calls.append(attr)
        return reference(*args)

    monkeypatch.setattr(module, attr, counted)
    if attr in ("_drop_run_c", "_chain_tops_c"):  # the general path, which drop_chains takes in one call
        monkeypatch.setattr(cache_eviction, "_drop_chains_c", _declined)
    slow = _replay(PrefixCache(BS, 200, host, policy=cls), seed)
    for step, (a, b) in enumerate(zip(fast, slow)):
        assert (a[0] == b[0]).all() and a[1:] == b[1:], f"request {step}"
    # the reference ran in the C function's place, wherever the cache calls it (with a host
    # tier victims are swapped out, not dropped a run at a time, and swap_chains tells chains)
    unused = (name not in POLICIES_USING.get(attr, (name,))
              or (attr in ("_drop_run_c", "_drop_chains_c", "_chain_tops_c") and host))
    assert bool(calls) != unused


def _declined(*args) -> None:
    """drop_chains declining every run: the cache takes its general path instead."""
    return None


@pytest.mark.parametrize("name", ["adaptive", "gaps", "reuse", "lru"])
@pytest.mark.parametrize("seed", range(2))
def test_drop_chains_equals_the_general_path(name, seed, monkeypatch):
    """An eviction run dropped in one call (drop_chains: whole chains, the policy's memory of
    what leaves written too) leaves the same cache and queues, at every step, as the general
    path (chain_tops, `_first_trigger`, the policy's forget, drop_run) does with the same runs."""
    fast = _c_replay(name, 0, seed)
    calls = []

    def declined(*args):
        calls.append(args)

    monkeypatch.setattr(cache_eviction, "_drop_chains_c", declined)
    slow = _replay(PrefixCache(BS, 200, 0, policy=make_policy(name)), seed)
    for step, (a, b) in enumerate(zip(fast, slow)):
        assert (a[0] == b[0]).all() and a[1:] == b[1:], f"request {step}"
    assert calls


@pytest.mark.parametrize("name", ["adaptive", "gaps", "reuse", "lru"])
@pytest.mark.parametrize("module,attr,reference", [
    pytest.param(module, attr, reference, id=attr) for module, attr, reference in (
        (cache_eviction, "_drop_host_run_c", ref.drop_host_run), (cache_eviction, "_mark_swap_out_c", ref.mark_swap_out),
        (cache_eviction, "_drop_host_nodes_c", ref.drop_host_nodes),
        (cache_eviction, "_free_host_nodes_c", ref.free_host_nodes),
        (cache_eviction, "_swap_chains_c", ref.swap_chains), (cache_eviction, "_mark_chains_c", ref.mark_chains),
        (cache_tasks, "_finish_swap_out_c", ref.finish_swap_out))])
def test_host_tier_c_work_equals_numpy(name, module, attr, reference, monkeypatch):
    """A host tier's drop of a run of host leaves (drop_host_run; node by node for a run of any
    shape: branches, parked parents, drop_host_nodes, then free_host_nodes), marking of swap-out victims
    (mark_swap_out; for whole chains, how much of the run goes, swap_chains, and the marking with
    the chains' tops' parents, mark_chains) and a swap-out's answer (finish_swap_out), in C or in numpy, leave the same
    cache, queues and policies at every step of a workload with requests in flight and a small
    host tier, whose eviction takes runs of every shape."""
    cls = make_policy(name)
    fast = _c_host_replay(name)
    calls = []

    def counted(*args):
        calls.append(attr)
        return reference(*args)

    monkeypatch.setattr(module, attr, counted)
    slow = _host_replay(cls)
    for step, (a, b) in enumerate(zip(fast, slow)):
        assert (a[0] == b[0]).all() and (a[1] == b[1]).all() and a[2:] == b[2:], f"step {step}"
    assert calls


@pytest.mark.parametrize("name", ["adaptive", "gaps", "reuse", "lru"])
@pytest.mark.parametrize("seed", range(2))
def test_swap_chains_equals_the_general_path(name, seed, monkeypatch):
    """A swap-out run of whole chains chosen and marked in two calls (swap_chains, mark_chains)
    leaves the same cache, queues and policies, at every step, as the general path (each
    node's fate, `_first_trigger`, mark_swap_out and its parents in numpy) does with the same
    runs: on the small host tier whose runs take every shape, and on a larger one."""
    fast = (_c_host_replay(name), _c_replay(name, 300, seed))
    calls = []

    def declined(*args):
        calls.append(args)

    monkeypatch.setattr(cache_eviction, "_swap_chains_c", declined)
    slow = (_host_replay(make_policy(name)), _replay(PrefixCache(BS, 200, 300, policy=make_policy(name)), seed))
    for step, (a, b) in enumerate(zip(fast[0], slow[0])):
        assert (a[0] == b[0]).all() and (a[1] == b[1]).all() and a[2:] == b[2:], f"step {step}"
    for step, (a, b) in enumerate(zip(fast[1], slow[1])):
        assert (a[0] == b[0]).all() and a[1:] == b[1:], f"request {step}"
    assert len(fast[0]) == len(slow[0]) and len(fast[1]) == len(slow[1]) and calls


@pytest.mark.parametrize("seed", range(2))
def test_host_drops_remember_as_forget_does(seed, monkeypatch):
    """Host leaves dropped a run at a time write `adaptive`'s memory of their keys in the same
    C call (drop_host_run with the policy's `remember_into`): the cache and both policies are
    left, at every step, as when the call hands the keys back and the policy's `forget` takes
    them."""
    fast = (_c_host_replay("adaptive"), _c_replay("adaptive", 300, seed))
    monkeypatch.setattr(adaptive.Adaptive, "remember_into", lambda self: None)
    slow = (_host_replay(make_policy("adaptive")),
            _replay(PrefixCache(BS, 200, 300, policy=make_policy("adaptive")), seed))
    for step, (a, b) in enumerate(zip(fast[0], slow[0])):
        assert (a[0] == b[0]).all() and (a[1] == b[1]).all() and a[2:] == b[2:], f"step {step}"
    for step, (a, b) in enumerate(zip(fast[1], slow[1])):
        assert (a[0] == b[0]).all() and a[1:] == b[1:], f"request {step}"
    assert len(fast[0]) == len(slow[0]) and len(fast[1]) == len(slow[1])


@pytest.mark.parametrize("seed", range(3))
def test_swap_chains_and_mark_chains_equal_numpy_on_any_queue(seed):
    """swap_chains and mark_chains against their references on runs of whole chains (and a run
    that is not) taken from a real cache's tree, with queues that hold any subset of the nodes:
    the replays' policies queue every parent a run leaves, so the cut and the parents handed
    back for queueing are checked here."""
    from kvrt.runtime.cache._cache_core import mark_chains, swap_chains
    rng = np.random.default_rng(seed)
    c = PrefixCache(BS, 200, 300, policy=make_policy("lru"))
    _replay(c, seed)
    f = c._f
    gpu = np.flatnonzero(f[STATE] == GPU)
    leaves = [int(v) for v in gpu if f[NDEV, v] == 0 and f[REF, v] == 0]
    cuts = parents = 0
    for _ in range(200):
        run: list[int] = []
        for v in rng.permutation(leaves)[:int(rng.integers(1, 4))].tolist():
            while True:  # a chain, deepest first, up to a random height
                run.append(v)
                p = int(f[PARENT, v])
                if p <= 0 or f[NDEV, p] != 1 or f[STATE, p] != GPU or rng.random() < 0.2:
                    break
                v = p
        cand = np.array(run, dtype=np.int32)
        if rng.random() < 0.1:
            cand = cand[::-1].copy()  # deepest last: not whole chains
        queue = set(rng.choice(gpu, size=len(gpu) // 2, replace=False).tolist())
        pos = np.full(f.shape[1], -1, dtype=np.int32)
        got = swap_chains(f, cand, cache_eviction.SWAP_CHAIN_ROWS, GPU, queue, pos)
        assert got == ref.swap_chains(f, cand, cache_eviction.SWAP_CHAIN_ROWS, GPU, queue, pos) and (pos == -1).all()
        if got is None:
            continue
        cuts += got < len(cand)
        vs = cand[:int(rng.integers(1, got + 1))]
        hosts = rng.integers(0, 1000, len(vs) + 2).astype(np.int32)
        out = []
        for mark in (mark_chains, ref.mark_chains):
            g, task, keys = f.copy(), c._task.copy(), list(c._keys)
            victims, devs, vkeys = np.zeros(len(vs) + 2, np.int32), np.zeros(len(vs) + 2, np.int32), []
            left = mark(g, vs, task, hosts, victims, devs, 2, cache_eviction.MARK_CHAIN_ROWS, 9, 7, keys, vkeys, GPU)
            out.append((g, task, victims, devs, vkeys, left))
        (g1, t1, i1, d1, k1, l1), (g2, t2, i2, d2, k2, l2) = out
        assert (g1 == g2).all() and (t1 == t2).all() and (i1 == i2).all() and (d1 == d2).all() and k1 == k2 and l1 == l2
        parents += bool(l1)
    assert cuts and parents  # (the workload reaches both)


def _host_replay(cls) -> list:
    """`_workload`'s requests, some in flight together, through a cache with a small host tier;
    the cache's state after each step."""
    c = PrefixCache(BS, 96, 32, policy=cls)
    states = []
    for op, rid, tokens in _workload(0, 300):
        if op == "start":
            if not c.match(rid, BlockHasher(BS).update(tokens), len(tokens)).ready:
                _settle(c)
            if c.allocate(rid, len(tokens)) is None:
                _settle(c)
                if not c.is_ready(rid) or c.allocate(rid, len(tokens)) is None:
                    continue  # (released when the workload finishes it)
            c.update(rid, len(tokens))
        else:
            c.release(rid)
        _settle(c)
        states.append((c._f.copy(), c._task.copy(), list(c._keys), dict(c._map), c._dev_lru.members(),
                       c._host_lru.members(), _policy_state(c._dev_lru), _policy_state(c._host_lru),
                       c.snapshot()))
    c.check()
    return states


def test_record_chain_checks_before_it_writes():
    """record_chain writes nothing when an argument is wrong, when its parent is detached or when
    the first key is a child already; else the chain's columns, its link and the new path."""
    rows = (PARENT, CHILD, DEV, REF, NDEV, STATE, CONT, NEXT, PREV)
    f = np.full((11, 8), -7, dtype=np.int32)
    f[:, 1] = -1
    f[STATE, 1], f[NDEV, 1] = GPU, 0
    stack = np.array([5, 3], dtype=np.int32)
    keys: list = [None] * 8
    kmap: dict = {}
    path = np.array([1], dtype=np.int32)
    out = np.empty(3, dtype=np.int32)
    before = f.copy()
    with pytest.raises(IndexError):
        record_chain(f, path, np.array([9, 3], dtype=np.int32), 2, [b"r", b"a", b"b"], [0, 1, 2], 3, rows, GPU,
                     DETACHED, keys, kmap, out)
    with pytest.raises(ValueError):
        record_chain(f, path.astype(np.int64), stack, 2, [b"r", b"a", b"b"], [0, 1, 2], 3, rows, GPU, DETACHED, keys,
                     kmap, out)
    with pytest.raises(ValueError):
        record_chain(f, path, stack, 2, [b"r", b"a", b"b"], [0, 1], 3, rows, GPU, DETACHED, keys, kmap, out)
    with pytest.raises(ValueError):
        record_chain(f, path, stack, 1, [b"r", b"a", b"b"], [0, 1, 2], 3, rows, GPU, DETACHED, keys, kmap, out)
    with pytest.raises(OverflowError):
        record_chain(f, path, stack, 2, [b"r", b"a", b"b"], [0, 1, 1 << 40], 3, rows, GPU, DETACHED, keys, kmap, out)
    assert (f == before).all() and keys == [None] * 8 and not kmap
    f[STATE, 1] = DETACHED
    assert record_chain(f, path, stack, 2, [b"r", b"a", b"b"], [0, 1, 2], 3, rows, GPU, DETACHED, keys, kmap, out) == -1
    f[STATE, 1] = GPU
    f[PARENT, 6], kmap[b"a"] = 1, 6  # b"a" is node 1's child already (through the key map)
    assert record_chain(f, path, stack, 2, [b"r", b"a", b"b"], [0, 1, 2], 3, rows, GPU, DETACHED, keys, kmap, out) == 0
    assert (f[:, :6] == before[:, :6]).all() and keys == [None] * 8
    del kmap[b"a"]
    assert record_chain(f, path, stack, 2, [b"r", b"a", b"b"], [0, 10, 11], 3, rows, GPU, DETACHED, keys, kmap,
                        out) == 2
    assert out.tolist() == [1, 5, 3] and f[CONT, 1] == 5 and f[CHILD, 1] == 5 and f[NDEV, 1] == 1 and not kmap
    assert f[PARENT, [5, 3]].tolist() == [1, 5] and f[CHILD, [5, 3]].tolist() == [3, -1]
    assert f[CONT, [5, 3]].tolist() == [3, -1] and f[DEV, [5, 3]].tolist() == [10, 11]
    assert f[REF, [5, 3]].tolist() == [1, 1] and f[NDEV, [5, 3]].tolist() == [1, 0]
    assert f[STATE, [5, 3]].tolist() == [GPU, GPU] and keys[5] == b"a" and keys[3] == b"b"
    assert f[PREV, 5] == -1 and f[NEXT, 5] == -1
    # a second chain under node 1: its first child now, found through the key map
    f[:, 2] = f[:, 4] = -1
    assert record_chain(f, path, np.array([4, 2], dtype=np.int32), 2, [b"r", b"c", b"d"], [0, 12, 13], 3, rows, GPU,
                        DETACHED, keys, kmap, out) == 2
    assert kmap == {b"c": 4} and f[CHILD, 1] == 4 and f[NEXT, 4] == 5 and f[PREV, 5] == 4 and f[NDEV, 1] == 2


def test_drop_run_checks_before_it_writes():
    f = np.full((11, 8), -1, dtype=np.int32)
    stack = np.zeros(8, dtype=np.int32)
    keys: list = [b"k%d" % i for i in range(8)]
    kmap: dict = {}
    rows = cache_eviction.DROP_ROWS
    reset = cache_eviction.RESET_ROW
    drop, par = np.array([3, 9], dtype=np.int32), np.array([0, 0], dtype=np.int32)
    with pytest.raises(IndexError):
        drop_run(f, drop, par, [1], rows, reset, keys, kmap, [], stack, 0)
    drop = np.array([3, 4], dtype=np.int32)
    with pytest.raises(IndexError):
        drop_run(f, drop, par, [2], rows, reset, keys, kmap, [], stack, 0)
    with pytest.raises(IndexError):
        drop_run(f, drop, par, [1], rows, reset, keys, kmap, [], stack, 7)  # the stack overflows
    assert (f == -1).all() and keys[3] == b"k3" and not stack.any()


def test_swap_out_marks_and_host_frees_check_their_room_before_they_write():
    """mark_swap_out and free_host_nodes write into caller-given int32 arrays from an offset:
    too little room there (or a node id out of range) is refused before anything is written."""
    f = np.full((11, 8), -1, dtype=np.int32)
    task = np.full(8, -1, dtype=np.int64)
    keys: list = [b"k%d" % i for i in range(8)]
    vs = np.array([3, 4], dtype=np.int32)
    hosts, victims, devs = (np.zeros(4, dtype=np.int32) for _ in range(3))
    rows = cache_eviction.SWAP_OUT_ROWS
    with pytest.raises(ValueError):
        mark_swap_out(f, vs, task, hosts, victims, devs, 3, rows, 1, 7, keys, [])  # room for one victim
    with pytest.raises(IndexError):
        mark_swap_out(f, np.array([3, 9], dtype=np.int32), task, hosts, victims, devs, 0, rows, 1, 7, keys, [])
    stack = np.zeros(8, dtype=np.int32)
    reset = cache_eviction.RESET_ROW
    with pytest.raises(ValueError):
        free_host_nodes(f, vs, task, stack, hosts, 7, 0, 9, reset, keys)  # the stack overflows
    with pytest.raises(ValueError):
        free_host_nodes(f, vs, task, stack, hosts, 0, 3, 9, reset, keys)  # so do the host blocks
    assert (f == -1).all() and (task == -1).all() and keys[3] == b"k3" and not stack.any()
    assert not (hosts.any() or victims.any() or devs.any())


def test_touch_and_deref_leave_a_path_off_the_device_alone():
    f = np.zeros((11, 8), dtype=np.int32)
    f[STATE, 5] = CPU
    f[DEV, [2, 5]] = [7, 9]
    before = f.copy()
    assert touch_device(f, np.array([2, 5], dtype=np.int32), REF, HITS, STATE, DEV, GPU) is None
    assert (f == before).all()
    assert touch_device(f, np.array([2, 3], dtype=np.int32), REF, HITS, STATE, DEV, GPU) == (2, [7, 0])
    assert f[REF, [2, 3]].tolist() == [1, 1] and f[HITS, [2, 3]].tolist() == [1, 1]
    f[REF, 5] = 2
    out = np.empty(3, dtype=np.int32)
    assert deref(f, np.array([2, 5, 3], dtype=np.int32), REF, STATE, GPU, out) == (2, True)
    assert out[:2].tolist() == [3, 2] and f[REF, 5] == 1
    with pytest.raises(IndexError):
        deref(f, np.array([8], dtype=np.int32), REF, STATE, GPU, out)
    with pytest.raises(ValueError):
        deref(f, np.array([2, 5, 3, 4], dtype=np.int32), REF, STATE, GPU, out)  # out too short


def test_a_run_popped_in_c_is_what_pops_give():
    """`ReuseLevels.pop_many` (the heap walked in C) returns what as many `pop` calls return,
    stale entries (discarded, pushed again) skipped, a partly used entry resumed, entries given
    back at the front (lists) mixed with pushed ones (arrays); and it leaves the heap, the
    stamps and the count of queued entries exactly as the Python walk with heapq does."""
    rng = np.random.default_rng(5)
    hits = rng.integers(0, 5, 300).astype(np.int32)
    queues = [reuse_levels.ReuseLevels(300, hits) for _ in range(3)]
    for q in queues:
        for j in range(15):
            q.push(np.arange(20 * j + 19, 20 * j - 1, -1, dtype=np.int32))
        q.discard(np.arange(0, 300, 7, dtype=np.int32))
        q.push(np.arange(0, 300, 21, dtype=np.int32))
    a, b, c = queues

    def heap(q) -> list:
        return [e[:4] + [np.asarray(e[4]).tolist(), e[5]] for e in q._heap]

    rounds = 0
    while True:
        k = int(rng.integers(1, 40))
        got = a.pop_many(k)
        want = [v for v in (b.pop() for _ in range(k)) if v >= 0]
        assert got.dtype == np.int32 and got.tolist() == want
        out = np.empty(k, dtype=np.int32)
        taken, dropped = ref.pop_live(c._heap, c._stamp, k, out)
        c._queued -= dropped
        assert out[:taken].tolist() == want
        assert heap(a) == heap(c) and a._stamp.tolist() == c._stamp.tolist() and a._queued == c._queued
        rounds += 1
        if rounds % 4 == 0 and len(got) > 2:  # give part of the run back, as a cut eviction run does
            for q in (a, b, c):
                q.push_front_run(got[1:].tolist())
        if not want:
            break
    with pytest.raises(ValueError):  # no room for k nodes
        reuse_levels._pop_c([], a._stamp, 5, np.empty(4, dtype=np.int32))
    with pytest.raises(TypeError):  # not a heap entry
        reuse_levels._pop_c([[0, 0, 0]], a._stamp, 1, np.empty(1, dtype=np.int32))


def test_policy_bookkeeping_in_c_equals_numpy():
    """The `reuse` family's per-node marks (policy_release, policy_discard) and the `gaps` ranking
    (gaps_rank) give exactly what their numpy references give on random inputs, every branch
    included (long gaps that lose the bonus, no bonus at all, runs of any length)."""
    from kvrt.runtime.cache._cache_core import gaps_rank, policy_discard, policy_release
    from kvrt.runtime.cache.policies.gaps import HOLD, LEVEL_SPAN
    from kvrt.runtime.cache.policies.reuse import LEVELS
    rng = np.random.default_rng(11)
    cap = 64
    for case in range(300):
        hits = rng.integers(0, 6, cap).astype(np.int32)
        nodes = rng.permutation(cap)[:int(rng.integers(0, cap))].astype(np.int32)
        if case % 3 == 0:  # paths: uses fall toward the leaf, so priorities form runs
            hits[nodes] = np.sort(hits[nodes])
        arrays = {"ghost": rng.integers(-1, 400, cap), "prio": rng.integers(0, 99, cap),
                  "stamp": rng.integers(-1, 9, cap), "released": rng.integers(0, 50, cap),
                  "matched": rng.random(cap) < 0.5}
        unit = float(rng.choice([0.0, rng.random() * 30, 200.0]))
        turnover = float(rng.random() * 60) if case % 2 else float(rng.integers(1, 60))  # ties too
        now, serial = int(rng.integers(50, 99)), int(rng.integers(0, 1000))
        heap = [[int(p), 0, -j - 1, -j - 1, [j], 0] for j, p in enumerate(rng.integers(0, 200, 12) * LEVEL_SPAN)]
        heapq.heapify(heap)  # entries already queued: the runs' entries go among them
        outs = []
        for impl in ((policy_release, policy_discard, gaps_rank),
                     (ref.policy_release, ref.policy_discard, ref.gaps_rank)):
            a = {k: v.copy() for k, v in arrays.items()}
            h = [e.copy() for e in heap]
            got = [impl[0](hits, a["matched"], a["released"], nodes, now),
                   impl[2](hits, a["ghost"], a["prio"], a["stamp"], nodes, LEVELS, HOLD, now, unit,
                           6.0 * turnover, 10.0 * turnover, LEVEL_SPAN, serial, h)]
            got.append(impl[1](a["stamp"], a["released"], a["matched"], nodes[::2].copy(), now + 1, turnover))
            got.append([e[:4] + [np.asarray(e[4]).tolist(), e[5]] for e in h])
            outs.append((got, {k: v.tolist() for k, v in a.items()}))
        assert outs[0] == outs[1], f"case {case}"
    with pytest.raises(IndexError):
        policy_release(hits, arrays["matched"], arrays["released"], np.array([cap], dtype=np.int32), 0)
    with pytest.raises(ValueError):
        policy_discard(arrays["stamp"], arrays["released"], arrays["matched"], nodes.astype(np.int64), 0, 1.0)


# the adaptive policy's C functions (runtime/cache/_cache_core.c adapt_*, ghost_ages) and their
# Python references, by the name the policy's module calls them
ADAPTIVE = {"_push_c": ref.adapt_push, "_front_c": ref.adapt_front, "_discard_c": ref.adapt_discard,
            "_missed_c": ref.adapt_missed, "_pop_c": ref.adapt_pop, "_forget_c": ref.adapt_forget,
            "_recall_c": ref.adapt_recall, "_ghost_c": ref.ghost_ages}


def _in_python(monkeypatch, calls: list) -> None:
    """Put the adaptive policy's Python references in place of its C functions, counting calls."""
    for attr, reference in ADAPTIVE.items():
        def counted(*args, _attr=attr, _ref=reference):
            calls.append(_attr)
            return _ref(*args)
        monkeypatch.setattr(adaptive, attr, counted)


@pytest.mark.parametrize("workload", ["one at a time", "host, in flight"])
def test_adaptive_policy_in_c_equals_python(workload, monkeypatch):
    """The default policy's every call (a release, a run given back, a match, a miss, a run
    popped, blocks forgotten and recalled) in C or in Python leaves the same cache, queues and
    policy state (its ledger, rings and heap, array for array) at every step: requests one at a
    time with eviction, then requests in flight together with a small host tier (parked
    victims, runs given back, host drops remembered, P in use)."""
    cls = make_policy("adaptive")
    replay = (lambda: _replay(PrefixCache(BS, 200, 0, policy=cls), 0)) if workload == "one at a time" else (
        lambda: _host_replay(cls))
    fast = _c_replay("adaptive", 0, 0) if workload == "one at a time" else _c_host_replay("adaptive")
    calls: list = []
    _in_python(monkeypatch, calls)
    monkeypatch.setattr(cache_eviction, "_drop_chains_c", _declined)  # (its forget is adapt_forget's C)
    slow = replay()
    for step, (a, b) in enumerate(zip(fast, slow)):
        arrays = 1 if workload == "one at a time" else 2  # the node matrix (and the task row)
        assert all((x == y).all() for x, y in zip(a[:arrays], b[:arrays])) and a[arrays:] == b[arrays:], f"step {step}"
    assert set(calls) == set(ADAPTIVE) - ({"_front_c"} if workload == "one at a time" else set())
    if workload != "one at a time":  # P held blocks: its ledger counted both ways
        ledger = fast[-1][6]
        assert ledger["gains"] and ledger["losses"] and ledger["lead"]


def _small_rings(q: adaptive.Adaptive, releases: int, serials: int) -> None:
    """Shrink the queue's rings (releases tracked, block serials, R's ring, P's heap) so that a
    short test wraps them all: what a long run does."""
    n = q._n
    q._t = np.zeros(5 * releases, dtype=np.int64)
    q._bits = np.zeros(serials, dtype=np.uint8)
    q._due = np.zeros(serials, dtype=np.int64)
    q._r = np.full(2 * (n + 16), -1, dtype=np.int64)
    q._h = np.zeros(4 * (n + 8), dtype=np.int64)
    q._args = (q._m, q._f, q._r, q._h, q._t, q._bits, q._st, q._hits)


def test_p_heap_compacted_and_popped_as_in_python(monkeypatch):
    """P's heap full of stale entries is compacted (its live entries kept and heapified again)
    when a node joins it, and then hands out its lowest: the same heap, array for array, and the
    same victims in C as in Python, with any number of live entries among the stale ones (the
    random queues above compact only nearly full heaps), the heap's top live or stale."""
    from kvrt.runtime.cache.policies.gaps import LEVEL_SPAN
    n, cap = 40, 48
    rng = np.random.default_rng(5)
    for case in range(300):
        live = int(rng.integers(1, cap + 1))
        nodes = rng.integers(0, n - 1, cap)
        nodes[:live] = rng.permutation(n - 1)[:live] if live < n else rng.integers(0, n - 1, live)
        where = rng.permutation(cap)
        where = np.concatenate(([0], where[where != 0]))  # the top is live: the pop compacts first
        if case % 2 and live < cap:  # or the top is stale: the pop skips it, compacting or not
            where[[0, live]] = where[[live, 0]]
        prio = rng.integers(0, 30, cap) * LEVEL_SPAN + rng.integers(0, 3, cap)  # ties of priority too
        got = []
        for in_python in (False, True):
            f = np.zeros((HITS + 1, n), dtype=np.int32)
            f[PARENT] = -1
            q = adaptive.Adaptive(n, f[HITS])
            q._h = np.zeros(4 * cap, dtype=np.int64)
            q._args = (q._m, q._f, q._r, q._h, q._t, q._bits, q._st, q._hits)
            h = q._h.reshape(-1, 4)
            for j in range(cap):  # entry where[j]: node nodes[j], serial j, live if its node's P serial is j
                h[where[j]] = (prio[j], j, nodes[j], j)
            pser = q._m[adaptive.M_PSER::adaptive.M_ROWS]
            for j in range(cap - 1, -1, -1):
                if j < live:
                    pser[nodes[j]] = j
            q._st[adaptive.A_HSIZE] = q._st[adaptive.A_PSER] = q._st[adaptive.A_ORDER] = cap
            q._st[adaptive.A_NP] = int((pser >= 0).sum())
            r = n - 1  # R's only node, with a bonus: it joins P, which compacts its heap first
            q._m[r * adaptive.M_ROWS + adaptive.M_PRIO] = 40 * LEVEL_SPAN
            q._m[r * adaptive.M_ROWS + adaptive.M_RSTAMP] = 0
            q._r[:2] = (r, 0)
            q._st[adaptive.A_RTAIL] = 1
            q.bank = n
            if in_python:
                _in_python(monkeypatch, [])
            got.append((q.pop_many(n).tolist(), _policy_state(q)))
            monkeypatch.undo()
        assert got[0][0] == got[1][0], f"case {case}"
        assert got[0][1] == got[1][1], f"case {case}: {[k for k in got[0][1] if got[0][1][k] != got[1][1][k]]}"


def test_adaptive_calls_in_c_equal_python_on_random_queues(monkeypatch):
    """Each of the adaptive policy's calls, on queues driven by random operations (releases of
    any nodes, queued or not; matches; misses of any age; runs popped, some of whose victims
    have device children left, and given back; blocks forgotten and recalled), returns the same
    and leaves the same state in C as in Python, with rings small enough that every one of them
    wraps and is compacted many times."""
    n = 48
    rng = np.random.default_rng(3)
    mats = [np.zeros((HITS + 1, n), dtype=np.int32) for _ in range(2)]
    parents = rng.integers(-1, n, n)
    for f in mats:
        f[PARENT] = parents
    queues = [adaptive.Adaptive(n, f[HITS]) for f in mats]
    for q in queues:
        _small_rings(q, 40, 512)
    key_of = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(n)]
    calls: list = []
    for step in range(2500):
        op = int(rng.integers(7))
        nodes = rng.permutation(n)[:int(rng.integers(1, 24))].astype(np.int32)
        ndev = rng.integers(0, 3, n) * (rng.random(n) < 0.1)
        hits = rng.integers(0, 5, n)
        ages = rng.integers(-1, int(queues[0]._st[0]) + 3, int(rng.integers(0, 30)))
        k, extra, start = int(rng.integers(1, 30)), int(rng.integers(0, 3)), int(rng.integers(0, n))
        budget = int(rng.integers(0, n))
        got = []
        for q, f in zip(queues, mats):
            if q is queues[1]:
                _in_python(monkeypatch, calls)
            f[NDEV], f[HITS] = ndev, hits
            q.bank = budget - int(q.allowance())  # (any budget: the policy's own is checked elsewhere)
            if op == 0:
                q.push(nodes)
                got.append((q._long, q._reused))
            elif op == 1:
                q.discard(nodes)
                got.append((q.gains, q._long, q._reused))
            elif op == 2:
                got.append(q.pop_many(k).tolist())
            elif op == 3:
                back = [int(v) for v in nodes if v not in q][:k]
                q.push_front_run(back)
                got.append(back)
            elif op == 4:
                q.missed(ages, len(ages) + extra)
                got.append((q.losses, q.lead, q.lookups, q._long, q._reused))
            elif op == 5:
                q.forget(nodes, key_of)
                got.append(None)
            else:
                got.append([a.tolist() for a in q.recall(key_of, start)])
            monkeypatch.undo()
        assert got[0] == got[1], f"step {step}"
        a, b = (_policy_state(q) for q in queues)
        assert a == b, f"step {step}: {[k for k in a if a[k] != b[k]]}"
    assert set(calls) == set(ADAPTIVE) - {"_ghost_c"}
    assert queues[0].gains and queues[0].losses and queues[0].lead


def test_touch_device_hands_out_the_pools_ints():
    """touch_device's block table holds the device pool's own int objects where it is given them
    (no new int per hit, which the request would free again), and the same values without."""
    f = np.full((11, 6), -1, dtype=np.int32)
    f[STATE], f[REF], f[HITS] = GPU, 0, 0
    f[DEV, [2, 4]] = 1000, 700
    ids = list(range(900))  # (blocks past 256: not ints the interpreter keeps one object of)
    unused, blocks = touch_device(f, np.array([2, 4], dtype=np.int32), REF, HITS, STATE, DEV, GPU, ids)
    assert unused == 2 and blocks == [1000, 700] and blocks[1] is ids[700]  # (1000: past the list, a new int)
    assert touch_device(f, np.array([4, 2], dtype=np.int32), REF, HITS, STATE, DEV, GPU) == (0, [700, 1000])
    assert f[REF, [2, 4]].tolist() == [2, 2] and f[HITS, [2, 4]].tolist() == [2, 2]
