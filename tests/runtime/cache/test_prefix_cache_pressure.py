"""The prefix cache when memory is short: a failed allocation changes nothing, deferred swap-ins
neither block nor strand anyone, write-through writes a block once, lookups stay in their
branch, and a request is counted once. Each test ends with the invariant checker."""
from __future__ import annotations

import numpy as np

from kvrt.runtime.cache.prefix_cache import PrefixCache, TaskKind
from kvrt.runtime.engine.scheduler import Scheduler
from kvrt.runtime.engine.sequence import Sequence
from tests.runtime.cache.test_prefix_cache import BS, finish, keys, run, toks


def test_a_failed_allocation_evicts_nothing():
    c = PrefixCache(BS, 8)
    for i in range(3):
        run(c, f"cached{i}", toks(100 * i, 2 * BS))  # 6 cached blocks, all evictable
    c.match("hold", [], 2 * BS)
    assert c.allocate("hold", 2 * BS) is not None  # the 2 free blocks
    c.match("big", [], 7 * BS)
    assert c.allocate("big", 7 * BS) is None, "6 evictable blocks cannot give 7"
    u = c.check()
    assert u["device_cached"] == 6 and c.metrics.evicted_device_blocks == 0, "the cache was flushed for nothing"
    assert c.reclaimable("big", 6 * BS) and not c.reclaimable("big", 7 * BS)
    c.release("big")
    c.release("hold")
    c.check()


def _deferred_swap_in(c: PrefixCache, prompt: np.ndarray) -> None:
    """Start request "l" whose prefix is on the host while the device is full of another
    request's blocks: its swap-in is deferred."""
    m = c.match("l", keys(prompt), len(prompt))
    assert m.host_tokens and not m.ready and not c.take_tasks(), "the swap-in is deferred"


def _grab(c: PrefixCache, rid: str, n_blocks: int) -> None:
    c.match(rid, [], n_blocks * BS)
    if c.allocate(rid, n_blocks * BS) is None:  # evicted blocks are still being swapped out
        finish(c)
        assert c.allocate(rid, n_blocks * BS) is not None


def _host_cache_with_deferred_swap_in() -> tuple[PrefixCache, np.ndarray]:
    """6 device blocks: "r" runs on 4, 2 are free, and "a"'s 3-block prefix is on the host."""
    c = PrefixCache(BS, 6, 8, low_water=0)
    a = toks(0, 3 * BS + 1)
    run(c, "a", a)
    _grab(c, "r", 4)
    _grab(c, "t", 2)
    c.release("t")
    u = c.check()
    assert u["device_free"] == 2 and u["host_cached"] == 3
    return c, a


def test_a_running_request_grows_ahead_of_a_deferred_swap_in():
    """2 free, 1 needed: served, although a deferred swap-in waits for 3."""
    c, a = _host_cache_with_deferred_swap_in()
    _deferred_swap_in(c, a)
    assert c.block_usage()["device_free"] == 2
    assert c.allocate("r", 5 * BS) is not None, "a free block was refused to a growing request"
    c.release("r")
    (t,) = c.take_tasks()
    assert t.kind is TaskKind.SWAP2GPU, "the release made room for the deferred swap-in"
    assert c.apply_task_result(t.task_id, True).ready == {"l": 3 * BS}
    c.release("l")
    c.check()


def test_a_deferred_swap_in_nobody_waits_for_is_dropped():
    c, a = _host_cache_with_deferred_swap_in()
    _deferred_swap_in(c, a)
    c.release("l")
    assert c.check()["host_cached"] >= 3, "its blocks stay on the host"
    c.release("r")
    assert not c.take_tasks(), "no swap-in for a request that left"
    assert c.match("again", keys(a), len(a)).host_tokens == 3 * BS
    c.release("again")
    c.check()


def test_failed_swap_outs_never_strand_a_deferred_swap_in():
    """The swap-outs that would make room fail (a paused cache-transfer rank times out): the
    swap-in must still start, with nothing else allocating."""
    c = PrefixCache(BS, 6, 8, low_water=0)
    a = toks(0, 3 * BS + 1)
    run(c, "a", a)
    run(c, "fill", toks(500, 6 * BS))  # a's blocks go to the host; fill's fill the device
    m = c.match("l", keys(a), len(a))
    assert not m.ready
    for _ in range(5):
        tasks = c.take_tasks()
        if not tasks:
            break
        for t in tasks:
            ok = t.kind is not TaskKind.SWAP2CPU  # every swap-out fails
            out = c.apply_task_result(t.task_id, ok)
            if out.ready:
                assert out.ready == {"l": 3 * BS}
                c.release("l")
                c.check()
                return
    raise AssertionError(f"request l never became ready; nothing in flight: {c.snapshot()['tasks_inflight']}")


def test_write_through_writes_each_block_once():
    stored: set[bytes] = set()

    def lookup(ks):
        n = 0
        while n < len(ks) and ks[n] in stored:
            n += 1
        return n

    c = PrefixCache(BS, 32, storage_lookup=lookup, write_through=True)
    p = toks(0, 4 * BS + 1)
    for rid in ("x", "y"):  # both compute the same blocks at once
        c.match(rid, keys(p), len(p))
        c.allocate(rid, len(p))
    for rid in ("x", "y"):
        c.update(rid, len(p))
    c.release("x")
    c.release("y")
    writes = c.take_tasks()
    assert [t.kind for t in writes] == [TaskKind.GPU2STORAGE] and len(writes[0].keys) == 4
    stored.update(writes[0].keys)
    c.apply_task_result(writes[0].task_id, True)
    # a request that read its prefix from storage does not write it back
    c2 = PrefixCache(BS, 32, storage_lookup=lookup, write_through=True)
    m = c2.match("z", keys(p), len(p))
    assert m.storage_tokens == 4 * BS
    (read,) = c2.take_tasks()
    c2.apply_task_result(read.task_id, True)
    c2.allocate("z", len(p))
    c2.update("z", len(p))
    c2.release("z")
    assert not c2.take_tasks(), "blocks just read from storage were written back"
    c2.check()


def test_a_failing_storage_lookup_is_a_miss():
    def broken(ks):
        raise OSError("store unreachable")

    c = PrefixCache(BS, 16, storage_lookup=broken)
    m = c.match("a", keys(toks(0, 3 * BS)), 3 * BS)
    assert m.cached_tokens == 0 and m.ready
    c.release("a")
    assert c.check()["device_used"] == 0


def test_unchained_keys_never_match_another_branch():
    c = PrefixCache(BS, 16)
    k1, k2, k3, k4 = (bytes([i]) * 16 for i in (1, 2, 3, 4))
    for rid, ks in (("a", [k1, k2]), ("b", [k1, k4]), ("c", [k3])):  # k4: a second child of k1
        n = len(ks) * BS + 1
        c.match(rid, ks, n)
        c.allocate(rid, n)
        c.update(rid, n)
        c.release(rid)
    # k4 sits under k1; a request whose first block is k3 must not find k4 under it
    assert c.lookup([k3, k4]) == 1
    assert c.match("d", [k3, k4], 2 * BS + 1).cached_tokens == BS
    c.release("d")
    c.check()


def test_a_preempted_request_is_counted_once():
    cache = PrefixCache(BS, 12)
    s = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [Sequence.new(str(i), toks(100 * i, 14), 6, BS) for i in range(3)]
    for q in seqs:
        s.add(q)
    while not s.idle:
        step = s.schedule()
        if step is not None:
            s.finish_step(step, np.full(len(step.seqs), 7, dtype=np.int32))
    assert s.preemptions > 0
    assert cache.metrics.requests == 3, "a request re-admitted after preemption was counted again"
    assert cache.metrics.query_tokens == 3 * 14
    cache.check()


def test_swap_ahead_keeps_blocks_coming_free_with_a_host_tier():
    """A request that allocates the device's last free blocks starts swap-outs of cached ones,
    so the next allocation finds blocks free instead of waiting for a swap-out round trip."""
    c = PrefixCache(BS, 8, 8, low_water=2)
    run(c, "a", toks(0, 6 * BS))                   # 6 cached blocks
    finish(c)
    c.match("b", [], 2 * BS)
    assert c.allocate("b", 2 * BS) is not None     # the last 2 free blocks
    (t,) = c.take_tasks()
    assert t.kind is TaskKind.SWAP2CPU and len(t.device_blocks) == 2
    c.apply_task_result(t.task_id, True)
    assert c.check()["device_free"] == 2
    assert c.allocate("b", 3 * BS) is not None, "served at once, no swap-out to wait for"
    c.release("b")
    c.check()
