"""The prefix cache's C inner loops (runtime/_cache_core.c) leave the cache exactly as the numpy
code they replace does: the same node matrix, keys, key map and queues after every request of a
workload with shared prefixes, branches and eviction (their Python code is the fallback when
the extension is not built)."""
from __future__ import annotations

import numpy as np
import pytest

from runtime import cache_eviction, cache_match
from runtime._cache_core import drop_run, new_chain
from runtime.cache_nodes import CHILD, CONT, DEV, GPU, NDEV, PARENT, REF, STATE
from runtime.cache_policy import make_policy
from runtime.hashing import BlockHasher
from runtime.prefix_cache import PrefixCache

BS = 4


def _replay(c: PrefixCache, seed: int) -> list:
    """Requests over a few prefixes with random tails, one at a time; the cache's state after each."""
    rng = np.random.default_rng(seed)
    bases = [rng.integers(0, 1 << 20, 120).astype(np.int32) for _ in range(3)]
    states = []
    for i in range(150):
        base = bases[int(rng.integers(0, 3))][:int(rng.integers(0, 120))]
        tokens = np.concatenate([base, rng.integers(0, 1 << 20, int(rng.integers(1, 40))).astype(np.int32)])
        c.match(i, BlockHasher(BS).update(tokens), len(tokens))
        if c.allocate(i, len(tokens)) is not None:
            c.update(i, len(tokens))
        c.release(i)
        states.append((c._f.copy(), list(c._keys), dict(c._map), c._dev_lru.members(), c.snapshot()))
    c.check()
    return states


@pytest.mark.parametrize("name", ["reuse", "lru"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("off", [(cache_match, "_new_chain_c"), (cache_eviction, "_drop_run_c")])
def test_c_recording_and_eviction_equal_numpy(name, seed, off, monkeypatch):
    """Recording a new chain (new_chain) and dropping an eviction run (drop_run, the batched
    path without a host tier) in C or in numpy leave the same cache at every step."""
    cls = make_policy(name)
    fast = _replay(PrefixCache(BS, 200, policy=cls), seed)
    monkeypatch.setattr(*off, None)
    slow = _replay(PrefixCache(BS, 200, policy=cls), seed)
    for step, (a, b) in enumerate(zip(fast, slow)):
        assert (a[0] == b[0]).all() and a[1:] == b[1:], f"request {step}"


def test_new_chain_checks_before_it_writes():
    f = np.full((11, 8), -7, dtype=np.int32)
    keys: list = [None] * 8
    rows = (PARENT, CHILD, DEV, REF, NDEV, STATE, CONT)
    with pytest.raises(IndexError):
        new_chain(f, np.array([3, 8], dtype=np.int32), 0, [1, 2], rows, GPU, keys, [b"a", b"b"])
    with pytest.raises(ValueError):
        new_chain(f, np.array([3, 4], dtype=np.int64), 0, [1, 2], rows, GPU, keys, [b"a", b"b"])
    with pytest.raises(ValueError):
        new_chain(f, np.array([3, 4], dtype=np.int32), 0, [1], rows, GPU, keys, [b"a", b"b"])
    assert (f == -7).all() and keys == [None] * 8
    new_chain(f, np.array([3, 5], dtype=np.int32), 1, [10, 11], rows, GPU, keys, [b"a", b"b"])
    assert f[PARENT, [3, 5]].tolist() == [1, 3] and f[CHILD, [3, 5]].tolist() == [5, -1]
    assert f[CONT, [3, 5]].tolist() == [5, -1] and f[DEV, [3, 5]].tolist() == [10, 11]
    assert f[REF, [3, 5]].tolist() == [1, 1] and f[NDEV, [3, 5]].tolist() == [1, 0]
    assert f[STATE, [3, 5]].tolist() == [GPU, GPU] and keys[3] == b"a" and keys[5] == b"b"


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
