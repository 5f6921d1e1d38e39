"""The prefix cache, one behaviour at a time (every test ends with the invariant checker)."""
from __future__ import annotations

import numpy as np
import pytest

from kvrt.runtime.cache.keys import BlockHasher
from kvrt.runtime.cache.policies.base import EvictionPolicy
from kvrt.runtime.cache.policies.lru import EvictionQueue
from kvrt.runtime.cache.prefix_cache import PrefixCache, TaskKind
from kvrt.runtime.client.trace import expand_tokens, load_trace, default_trace_path

BS = 4


def toks(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def keys(t: np.ndarray, bs: int = BS) -> list[bytes]:
    return BlockHasher(bs).update(t)


def run(c: PrefixCache, rid, t: np.ndarray, decode: int = 0, release: bool = True):
    """Admit, compute the whole prompt, optionally decode, release: one request, start to end."""
    m = c.match(rid, keys(t, c.block_size), len(t))
    finish(c)
    if c.allocate(rid, len(t) + decode) is None:  # blocks still being swapped out
        finish(c)
        assert c.allocate(rid, len(t) + decode) is not None
    c.update(rid, len(t))
    if release:
        c.release(rid)
        finish(c)
    c.check()
    return m


def finish(c: PrefixCache, ok: bool = True):
    """Apply every task the cache has issued, as the cache-transfer ranks would; outcomes."""
    out = []
    while tasks := c.take_tasks():
        out += [c.apply_task_result(t.task_id, ok) for t in tasks]
    return out


def usage(c: PrefixCache) -> dict:
    return c.check()


# ---- matching, allocation, recording, release ---------------------------------------------
def test_second_request_hits_the_shared_prefix():
    c = PrefixCache(BS, 64)
    a = toks(0, 10 * BS + 2)
    run(c, "a", a)
    b = np.concatenate([a[:7 * BS + 1], toks(1000, 9)])
    m = c.match("b", keys(b), len(b))
    assert m.device_tokens == 7 * BS and m.host_tokens == m.storage_tokens == 0 and m.ready
    assert m.block_ids == c.block_table("b")
    c.release("b")
    u = usage(c)
    assert u["device_used"] == 0 and u["device_cached"] == 10


def test_whole_prompt_match_gives_one_block_back():
    c = PrefixCache(BS, 16)
    a = toks(0, 3 * BS)
    run(c, "a", a)
    m = run(c, "b", a, release=False)
    assert m.device_tokens == 2 * BS  # the last token is recomputed, so its block is too
    assert c.metrics.backoff_tokens == BS
    assert c.update("b", len(a)) == 3 * BS  # the recomputed block adopts the cached node
    c.release("b")
    u = usage(c)
    assert u["device_cached"] == 3 and u["device_used"] == 0  # the private copy was freed


def test_release_frees_partial_and_decode_blocks():
    c = PrefixCache(BS, 32)
    run(c, "a", toks(0, 5 * BS + 3), decode=4 * BS)
    u = usage(c)
    assert u["device_cached"] == 5 and u["device_free"] == 27 and u["device_used"] == 0


def test_only_written_blocks_are_matchable():
    """Seed bug (b): B arrives while A is mid-prefill and must match only A's recorded blocks."""
    c = PrefixCache(BS, 64)
    a = toks(0, 12 * BS + 1)
    c.match("a", keys(a), len(a))
    assert c.allocate("a", len(a)) is not None  # all blocks allocated, none written yet
    assert c.match("b0", keys(a), len(a)).cached_tokens == 0
    c.update("a", 3 * BS + 2)  # chunked prefill: 3 full blocks written
    assert c.match("b1", keys(a), len(a)).device_tokens == 3 * BS
    c.update("a", 9 * BS)
    assert c.match("b2", keys(a), len(a)).device_tokens == 9 * BS
    for rid in ("a", "b0", "b1", "b2"):
        c.release(rid)
    c.check()


def test_concurrent_duplicates_keep_their_private_copies():
    """Two requests compute the same prefix at once: the second to record adopts the first's
    nodes and keeps its own blocks privately until it finishes; nothing leaks."""
    c = PrefixCache(BS, 64)
    a = toks(0, 6 * BS + 1)
    for rid in ("x", "y"):
        c.match(rid, keys(a), len(a))
        c.allocate(rid, len(a))
    c.update("x", len(a))
    c.update("y", len(a))
    c.check()
    assert c.block_table("x") != c.block_table("y")
    c.release("x")
    c.release("y")
    u = usage(c)
    assert u["device_cached"] == 6 and u["device_used"] == 0


def test_prefill_node_hit_rate_equals_mixed():
    """Seed bug (a): a prefill node (records as chunks are written, never decodes) caches as much
    as a mixed node on the same multi-turn workload."""
    reqs = load_trace(default_trace_path(), limit=300)
    bs, chunk = 64, 2048
    total = sum(-(-(r.input_length + r.output_length) // bs) for r in reqs)

    def replay(prefill_only: bool) -> float:
        c = PrefixCache(bs, total)
        for i, r in enumerate(reqs):
            t = expand_tokens(r)
            c.match(i, keys(t, bs), len(t))
            c.allocate(i, len(t))
            if prefill_only:
                for done in range(chunk, len(t) + chunk, chunk):
                    c.update(i, min(done, len(t)))
            else:
                c.update(i, len(t))
                c.allocate(i, len(t) + r.output_length)  # decode room, then finish
            c.release(i)
        c.check()
        return c.metrics.hit_rate()

    p_node, mixed = replay(True), replay(False)
    assert p_node == mixed > 0.05  # a node that never recorded its prefills would show 0


# ---- eviction --------------------------------------------------------------------------------
def test_eviction_is_lru_tail_first_and_cascades():
    c = PrefixCache(BS, 8)
    a, b = toks(0, 3 * BS + 1), toks(500, 3 * BS + 1)
    run(c, "a", a)
    run(c, "b", b)  # 6 cached, 2 free
    ka = keys(a)
    run(c, "c", toks(900, 2 * BS + 1))  # needs 3: 2 free + a's deepest block
    assert c.lookup(ka) == 2 and c.lookup(keys(b)) == 3
    assert c.metrics.evicted_device_blocks == 1  # only need - free
    run(c, "d", toks(1300, 2 * BS + 1))  # a's chain goes next, parent after child
    assert c.lookup(ka) == 0 and c.lookup(keys(b)) == 3


class MostRecentFirst(EvictionPolicy):
    """An alternative eviction policy (most recently released first), to show the policy is one
    class passed to the cache. O(n) per call: for this test only."""

    def __init__(self, capacity: int, hits: np.ndarray):
        self.order: list[int] = []  # the next victim at the end

    def __contains__(self, n: int) -> bool:
        return n in self.order

    def push(self, nodes: np.ndarray) -> None:
        self.discard(nodes)
        self.order += nodes.tolist()

    def push_front(self, n: int) -> None:
        self.order.append(n)

    def discard(self, nodes: np.ndarray) -> None:
        gone = set(np.asarray(nodes).tolist())
        self.order = [n for n in self.order if n not in gone]

    def discard_one(self, n: int) -> None:
        self.discard(np.array([n]))

    def pop(self) -> int:
        return self.order.pop() if self.order else -1

    def pop_many(self, k: int) -> np.ndarray:
        return np.array([v for v in (self.pop() for _ in range(k)) if v >= 0], dtype=np.int32)

    def members(self) -> list[int]:
        return self.order[::-1]

    stamped = members


def test_the_eviction_policy_is_pluggable():
    """The cache evicts in the order of the policy it is given: under most-recent-first the
    request released last loses its blocks, where LRU (the default) takes the older one's."""
    for policy, kept in ((None, "b"), (MostRecentFirst, "a")):
        c = PrefixCache(BS, 8, **({"policy": policy} if policy else {}))
        a, b = toks(0, 3 * BS + 1), toks(500, 3 * BS + 1)
        run(c, "a", a)
        run(c, "b", b)
        run(c, "c", toks(900, 4 * BS + 1))  # 2 free: three blocks go
        cached = {"a": c.lookup(keys(a)), "b": c.lookup(keys(b))}
        assert cached[kept] == 3 and cached[{"a": "b", "b": "a"}[kept]] < 3
        c.check()


def test_matched_blocks_become_recent():
    c = PrefixCache(BS, 8)
    a, b = toks(0, 3 * BS + 1), toks(500, 3 * BS + 1)
    run(c, "a", a)
    run(c, "b", b)
    run(c, "a2", a)  # a is used again: b is now the least recently used
    run(c, "c", toks(900, 3 * BS + 1))
    assert c.lookup(keys(a)) == 3 and c.lookup(keys(b)) < 3


def test_referenced_blocks_are_never_evicted():
    c = PrefixCache(BS, 8)
    a = toks(0, 5 * BS + 1)
    run(c, "a", a, release=False)  # 6 blocks held by a live request
    c.match("b", [], 3 * BS)
    assert c.allocate("b", 3 * BS) is None  # only 2 free, nothing evictable
    assert c.lookup(keys(a)) == 5
    c.release("a")
    assert c.allocate("b", 3 * BS) is not None
    c.release("b")
    c.check()


def test_eviction_cascades_through_a_parked_parent():
    """A parent whose device child is still referenced is skipped and comes back as a leaf."""
    c = PrefixCache(BS, 10)
    base = toks(0, 2 * BS)
    run(c, "a", np.concatenate([base, toks(100, BS + 1)]))
    run(c, "b", np.concatenate([base, toks(200, BS + 1)]), release=False)  # shares base, held
    run(c, "c", toks(900, 2 * BS + 1))
    run(c, "d", toks(1300, 2 * BS + 1))
    c.release("b")
    run(c, "e", toks(1700, 7 * BS + 1))
    c.check()


# ---- host tier -------------------------------------------------------------------------------
def host_cache(device=6, host=8) -> PrefixCache:
    """A host tier that swaps out only on demand (no swap-ahead), so each test sees exactly the
    evictions it asks for."""
    return PrefixCache(BS, device, host, low_water=0)


def test_swap_out_then_swap_in():
    c = host_cache()
    a = toks(0, 3 * BS + 1)
    run(c, "a", a)
    c.match("b", [], 6 * BS)
    assert c.allocate("b", 6 * BS) is None  # 3 free; the other 3 are being swapped out
    (t,) = c.take_tasks()
    assert t.kind is TaskKind.SWAP2CPU and len(t.device_blocks) == len(t.host_blocks) == 3
    assert t.keys == keys(a)[::-1]  # deepest first
    c.check()
    c.apply_task_result(t.task_id, True)
    assert c.allocate("b", 6 * BS) is not None
    c.release("b")
    m = c.match("a2", keys(a), len(a))
    assert m.host_tokens == 3 * BS and not m.ready
    (t,) = c.take_tasks()
    assert t.kind is TaskKind.SWAP2GPU and not c.is_ready("a2")
    with pytest.raises(RuntimeError):
        c.update("a2", 2 * BS)  # not runnable before the swap-in is done
    out = c.apply_task_result(t.task_id, True)
    assert out.ready == {"a2": 3 * BS} and c.is_ready("a2")
    assert c.block_table("a2") == m.block_ids and -1 not in m.block_ids
    c.allocate("a2", len(a))
    c.update("a2", len(a))
    c.release("a2")
    assert c.metrics.hit_tokens_host == 3 * BS and c.metrics.swap_in_blocks == 3
    c.check()


def test_rematch_during_swap_out_flips_back():
    c = host_cache()
    a = toks(0, 3 * BS + 1)
    run(c, "a", a)
    c.match("b", [], 6 * BS)
    assert c.allocate("b", 6 * BS) is None
    (out,) = c.take_tasks()
    m = c.match("a2", keys(a), len(a))  # before the swap-out finished
    assert m.device_tokens == 3 * BS and m.ready  # still readable on the device
    assert c.metrics.swap_out_cancelled == 3
    c.check()
    c.apply_task_result(out.task_id, True)  # host blocks recycled, nodes stay GPU
    u = usage(c)
    assert u["host_free"] == 8 and u["host_cached"] == 0
    c.release("a2")
    c.release("b")
    c.check()


def test_a_block_wanted_back_is_not_evicted_again_while_its_old_swap_out_reads_it():
    """A swap-out still copies the device blocks of nodes that were matched again (flipped
    back): until it answers they are parked, neither handed to a second swap-out nor freed for
    a step to write into while the cache-transfer rank reads them."""
    c = host_cache()
    a = toks(0, 3 * BS + 1)
    run(c, "a", a)
    c.match("b", [], 6 * BS)
    assert c.allocate("b", 6 * BS) is None
    (first,) = c.take_tasks()
    c.match("a2", keys(a), len(a))  # flipped back: GPU again, the swap-out still in flight
    c.release("a2")
    c.release("b")
    c.match("c", [], 6 * BS)
    c.allocate("c", 6 * BS)  # wants the device blocks of a's nodes again
    read = set(first.device_blocks)
    for t in c.take_tasks():
        assert not read & set(t.device_blocks), "a second task would read blocks the first still reads"
    assert not read & set(c.block_table("c")), "a step would write blocks a swap-out still reads"
    c.check()
    c.apply_task_result(first.task_id, True)  # now they may go
    c.release("c")
    c.match("d", [], 6 * BS)
    assert c.allocate("d", 6 * BS) is None
    (again,) = c.take_tasks()
    assert read <= set(again.device_blocks)
    c.apply_task_result(again.task_id, True)
    c.check()


def test_a_block_wanted_back_and_then_dropped_stays_with_the_swap_out_that_reads_it():
    """Block a's swap-out is done, its child b's is still in flight; a request matches both
    (a swapped in, b flipped back) and a's swap-in fails, which drops a and b. When the request
    leaves, b's device block must stay with b's swap-out, which still reads it, not go back to
    the free list for a step to write into under the copy."""
    c = PrefixCache(BS, 4, 8, low_water=0)
    ab = toks(0, 2 * BS + 1)
    run(c, "r1", ab)
    other = keys(toks(1000, 2 * BS + 1))
    c.match("x", other, 2 * BS + 1)
    c.allocate("x", 2 * BS + 1)
    assert c.allocate("x", 3 * BS) is None  # evicts b
    (out_b,) = c.take_tasks()
    assert c.allocate("x", 4 * BS) is None  # evicts a
    (out_a,) = c.take_tasks()
    c.release("x")
    c.apply_task_result(out_a.task_id, True)
    res = c.match("r2", keys(ab), len(ab))  # a: a swap-in; b: flipped back
    assert res.host_tokens == BS and res.device_tokens == BS
    (swap_in,) = c.take_tasks()
    assert c.apply_task_result(swap_in.task_id, False).failed == ["r2"]
    c.release("r2")
    assert not set(out_b.device_blocks) & set(c.device_pool.free_blocks())
    c.check()
    c.apply_task_result(out_b.task_id, True)
    assert c.device_pool.num_free == 4
    c.check()


def test_failed_swap_out_drops_the_blocks_it_was_to_free():
    """A failing (or timed-out) host tier must not be offered the same blocks for ever while
    the request that needs them waits: the victims are dropped and their blocks are free."""
    c = host_cache()
    a = toks(0, 3 * BS + 1)
    run(c, "a", a)
    c.match("b", [], 6 * BS)
    assert c.allocate("b", 6 * BS) is None
    finish(c, ok=False)
    assert c.metrics.tasks_failed == 1
    assert c.allocate("b", 6 * BS) is not None, "the dropped victims' blocks serve the request"
    assert not c.take_tasks(), "no second swap-out of the same blocks"
    m = c.match("a2", keys(a), len(a))
    assert m.cached_tokens < 3 * BS
    c.release("a2")
    c.release("b")
    assert usage(c)["host_free"] == 8
    c.check()


def swap_in_task(c: PrefixCache):
    """Let the swap-outs a swap-in may wait for finish; return the (single) swap-in task."""
    while True:
        tasks = c.take_tasks()
        swap_ins = [t for t in tasks if t.kind is TaskKind.SWAP2GPU]
        for t in tasks:
            if t.kind is not TaskKind.SWAP2GPU:
                c.apply_task_result(t.task_id, True)
        if swap_ins:
            (t,) = swap_ins
            return t


def test_failed_swap_in_drops_nodes_and_fails_waiters():
    c = host_cache(device=8, host=8)
    a = toks(0, 3 * BS + 1)
    run(c, "a", a)
    run(c, "x", toks(500, 6 * BS + 1))  # pushes a to the host
    assert c.lookup(keys(a)) == 3
    m1 = c.match("r1", keys(a), len(a))
    m2 = c.match("r2", keys(a)[:2], 2 * BS + 1)  # joins the same swap-in
    assert m1.pending_tasks == m2.pending_tasks
    t = swap_in_task(c)
    out = c.apply_task_result(t.task_id, False)
    assert sorted(out.failed) == ["r1", "r2"] and not out.ready
    assert c.lookup(keys(a)) == 1  # the two that never arrived are dropped; the first stays
    c.check()
    c.release("r1")
    c.release("r2")
    u = usage(c)
    assert u["device_used"] == u["host_used"] == 0


def test_deferred_swap_in_waits_for_swap_out():
    """Device full of cached blocks: a host hit's destinations are still being copied out, so
    the swap-in is deferred and issued when the swap-out reports done."""
    c = host_cache(device=6, host=8)
    a = toks(0, 3 * BS + 1)
    run(c, "a", a)
    run(c, "x", toks(500, 5 * BS + 1))  # a on host, device full with x
    m = c.match("a2", keys(a), len(a))
    assert m.host_tokens == 3 * BS and -1 in m.block_ids
    (out,) = c.take_tasks()
    assert out.kind is TaskKind.SWAP2CPU  # the swap-in is not issued yet
    c.check()
    c.apply_task_result(out.task_id, True)
    (inn,) = c.take_tasks()
    assert inn.kind is TaskKind.SWAP2GPU and inn.task_id in m.pending_tasks
    assert -1 not in c.block_table("a2")
    assert c.apply_task_result(inn.task_id, True).ready == {"a2": 3 * BS}
    c.release("a2")
    c.check()


def test_host_eviction_during_a_match_spares_the_matched_nodes():
    """Making room for a host hit can evict the hit's own host child; its parent, just matched,
    must not become an evictable host leaf."""
    c = host_cache(device=4, host=3)
    a = toks(0, 3 * BS + 1)
    run(c, "a", a)
    run(c, "x", toks(500, 3 * BS + 1))  # a's three blocks go to the host, which is now full
    m = c.match("r", keys(a)[:2], 2 * BS + 1)  # host hits a1, a2; room comes from dropping a3
    assert m.host_tokens == 2 * BS
    c.check()
    t = swap_in_task(c)
    assert c.apply_task_result(t.task_id, True).ready == {"r": 2 * BS}
    assert c.lookup(keys(a)) == 2
    c.release("r")
    c.check()


def test_request_released_before_its_swap_in_finishes():
    c = host_cache(device=8, host=8)
    a = toks(0, 3 * BS + 1)
    run(c, "a", a)
    run(c, "x", toks(500, 6 * BS + 1))
    c.match("r", keys(a), len(a))
    c.release("r")
    c.check()
    finish(c)
    assert c.lookup(keys(a)) == 3
    u = usage(c)
    assert u["device_used"] == u["host_used"] == 0


# ---- storage tier ----------------------------------------------------------------------------
class FakeStorage:
    def __init__(self):
        self.keys: set[bytes] = set()

    def lookup(self, ks) -> int:
        n = 0
        while n < len(ks) and ks[n] in self.keys:
            n += 1
        return n


def test_storage_read_records_blocks():
    st = FakeStorage()
    c = PrefixCache(BS, 32, storage_lookup=st.lookup)
    a = toks(0, 6 * BS + 1)
    st.keys.update(keys(a)[:4])
    m = c.match("a", keys(a), len(a))
    assert m.storage_tokens == 4 * BS and not m.ready
    (t,) = c.take_tasks()
    assert t.kind is TaskKind.STORAGE2GPU and t.keys == keys(a)[:4] and not t.host_blocks
    assert c.apply_task_result(t.task_id, True).ready == {"a": 4 * BS}
    assert c.lookup(keys(a)) == 4  # read blocks are in the tree now
    c.allocate("a", len(a))
    c.update("a", len(a))
    c.release("a")
    assert c.match("b", keys(a), len(a)).device_tokens == 6 * BS
    c.release("b")
    assert c.metrics.hit_tokens_storage == 4 * BS and c.metrics.storage_read_blocks == 4
    c.check()


@pytest.mark.parametrize("ok, read, cached", [(True, 2, 2), (False, None, 0), (False, 1, 1)])
def test_short_or_failed_storage_read_falls_back_to_compute(ok, read, cached):
    st = FakeStorage()
    c = PrefixCache(BS, 32, storage_lookup=st.lookup)
    a = toks(0, 6 * BS + 1)
    st.keys.update(keys(a)[:4])
    m = c.match("a", keys(a), len(a))
    (t,) = c.take_tasks()
    out = c.apply_task_result(t.task_id, ok, blocks=read)
    assert out.ready == {"a": cached * BS}
    assert c.lookup(keys(a)) == cached
    assert c.block_table("a") == m.block_ids  # the unread blocks are computed in place
    c.allocate("a", len(a))
    c.update("a", len(a))
    c.release("a")
    assert c.lookup(keys(a)) == 6
    c.check()


def test_release_during_storage_read():
    st = FakeStorage()
    c = PrefixCache(BS, 32, storage_lookup=st.lookup)
    a = toks(0, 6 * BS + 1)
    st.keys.update(keys(a))
    c.match("a", keys(a), len(a))
    c.allocate("a", len(a) + 8)
    c.release("a")
    c.check()  # the read's destinations still belong to the task
    finish(c)
    assert usage(c)["device_used"] == 0 and c.lookup(keys(a)) == 0


def test_write_through_pins_blocks_until_written():
    st = FakeStorage()
    c = PrefixCache(BS, 8, storage_lookup=st.lookup, write_through=True)
    a = toks(0, 3 * BS + 1)
    run(c, "a", a, release=False)
    c.release("a")
    (t,) = c.take_tasks()
    assert t.kind is TaskKind.GPU2STORAGE and t.keys == keys(a) and len(t.device_blocks) == 3
    c.match("b", [], 7 * BS)
    assert c.allocate("b", 7 * BS) is None  # a's blocks are being read: not evictable
    c.apply_task_result(t.task_id, True)
    assert c.allocate("b", 7 * BS) is not None
    c.release("b")
    assert c.metrics.storage_write_blocks == 3
    c.check()


# ---- reset -------------------------------------------------------------------------------------
class Told:
    """An observer that records what it is told."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def stored(self, medium, keys, parent) -> None:
        self.calls.append(f"stored {medium}")

    def removed(self, medium, keys) -> None:
        self.calls.append(f"removed {medium}")

    def cleared(self) -> None:
        self.calls.append("cleared")


def test_reset_frees_what_nothing_holds_now_and_the_rest_when_released():
    c = host_cache(device=12, host=8)
    a, b, live = toks(0, 3 * BS + 1), toks(100, 2 * BS + 1), toks(300, 2 * BS + 1)
    run(c, "a", a)
    run(c, "b", b)
    run(c, "live", live, release=False)  # holds 2 cached blocks (and its partial one)
    c.match("x", [], 6 * BS)
    assert c.allocate("x", 6 * BS) is None  # a's two deepest blocks go to the host
    finish(c)
    c.release("x")
    c.match("y", [], 7 * BS)
    assert c.allocate("y", 7 * BS) is None  # a's first block is being swapped out: in flight
    (out,) = c.take_tasks()
    c.release("y")
    told = Told()
    c.observe(told)
    got = c.reset()
    assert (got.device, got.host) == (2, 2)  # b's blocks; a's two on the host
    assert (got.held_device, got.held_host) == (3, 1)  # live's two, and both copies of the one in flight
    assert told.calls == ["cleared"], "one event says it all: nothing stays in the tree"
    u = usage(c)
    assert u["device_cached"] == u["host_cached"] == 0 and (u["device_used"], u["host_used"]) == (4, 1)
    assert c.lookup(keys(a)) == c.lookup(keys(b)) == c.lookup(keys(live)) == 0
    c.apply_task_result(out.task_id, True)  # its blocks were held only for the copy
    assert c.update("live", len(live)) == 2 * BS  # a request from before records nothing more
    c.release("live")
    u = usage(c)
    assert (u["device_free"], u["host_free"]) == (12, 8)
    assert run(c, "again", live).cached_tokens == 0
    assert run(c, "again2", live).cached_tokens == 2 * BS, "the cache fills again after a reset"


# ---- node ids, queue, metrics, errors --------------------------------------------------------
def test_node_ids_are_reused_without_stale_fields():
    c = host_cache(device=10, host=6)
    rng = np.random.default_rng(1)
    for i in range(60):
        t = toks(int(rng.integers(0, 6)) * 1000, int(rng.integers(1, 8)) * BS + 1)
        run(c, i, t)  # check() verifies every free id is fully reset


def test_eviction_queue_order_discard_front_and_compaction():
    q = EvictionQueue(8)
    q.push(np.array([1, 2, 3], dtype=np.int32))
    q.push(np.array([4, 5], dtype=np.int32))
    q.discard(np.array([2], dtype=np.int32))
    q.push_front(6)
    assert 2 not in q and 6 in q
    assert [q.pop() for _ in range(3)] == [6, 1, 3]
    q.push(np.array([1], dtype=np.int32))  # re-pushed: moves to the end
    for _ in range(20):  # stale entries pile up, compaction keeps order and bounds them
        q.push(np.array([7], dtype=np.int32))
    assert q.members() == [4, 5, 1, 7]
    assert [q.pop() for _ in range(5)] == [4, 5, 1, 7, -1]


def test_metrics_keep_numerators_and_denominators():
    c = PrefixCache(BS, 32)
    run(c, "a", toks(0, 4 * BS))
    run(c, "b", np.concatenate([toks(0, 2 * BS), toks(900, 3)]))  # shares 2 of a's blocks
    run(c, "c", toks(0, 2 * BS + 3))  # all full blocks hit; its partial tail lies in a's block
    s = c.snapshot()
    assert s["requests"] == 3 and s["hit_requests"] == 2
    assert s["query_tokens"] == 4 * BS + 2 * BS + 3 + 2 * BS + 3
    assert s["hit_tokens_device"] == 4 * BS and s["hit_tokens"] == 4 * BS
    assert s["partial_block_tokens"] == 3 + 3
    assert s["hit_token_rate"] == pytest.approx(4 * BS / s["query_tokens"])
    for key in ("device_total", "device_free", "device_cached", "device_used", "host_free",
                "evicted_device_blocks", "swap_in_blocks", "query_tokens_host",
                "hit_tokens_storage", "request_hit_rate", "hit_token_rate_host"):
        assert key in s


def test_errors_are_clear():
    c = PrefixCache(BS, 8)
    c.match("a", keys(toks(0, 2 * BS)), 2 * BS)
    with pytest.raises(ValueError, match="already"):
        c.match("a", [], 1)
    with pytest.raises(KeyError, match="not in the prefix cache"):
        c.release("nope")
    with pytest.raises(ValueError, match="allocated"):
        c.update("a", 2 * BS)
    with pytest.raises(ValueError, match="not in flight"):
        c.apply_task_result(99, True)
    with pytest.raises(ValueError):
        c.match("z", [], 0)
    c.release("a")
    c.check()
